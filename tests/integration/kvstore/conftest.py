from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.harness import start_s3_server


@pytest.fixture(scope="package")
def s3_endpoint() -> Iterator[str]:
    """One real S3 server (SeaweedFS, a subprocess on loopback) for these integration tests."""
    url, stop = start_s3_server()
    try:
        yield url
    finally:
        stop()
