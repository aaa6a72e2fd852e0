"""One cluster (the random-weight demo model) for the agent API tests, and an OpenAI client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from bench.harness import Cluster, start_cluster


@pytest.fixture(scope="package")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with start_cluster(tmp_path_factory.mktemp("agents"), tiny_model) as c:
        yield c


@pytest.fixture
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", timeout=120,
                         max_retries=0)
