from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.s3_server import start_moto_server


@pytest.fixture(scope="package")
def moto_endpoint() -> Iterator[str]:
    """One real moto S3 server (subprocess on loopback) for the kvstore integration tests."""
    url, stop = start_moto_server()
    try:
        yield url
    finally:
        stop()
