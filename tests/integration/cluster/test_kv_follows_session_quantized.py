"""A session's KV pulled from the peer node with int4 weights (engines started with
``--dtype q4``): turns alternating between two nodes equal recomputation with the same
quantized weights, token for token."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.engine.api_types import ChatMessage
from services.engine.model import LoadedModel, load_model
from tests.cluster import Cluster, start_cluster
from tests.integration.cluster.test_kv_follows_session import (
    ENGINE,
    KVSTORE,
    SESSION_TURNS,
    test_turns_alternating_between_nodes_reuse_their_history,
)
from tests.integration.reuse.harness import reference_transcript

__all__ = ["test_turns_alternating_between_nodes_reuse_their_history"]


@pytest.fixture(scope="module")
def loaded(tiny_model: Path) -> LoadedModel:
    return load_model(tiny_model, dtype=torch.float32, quant="q4")


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel) -> list[tuple[list[ChatMessage], list[int], str]]:
    return asyncio.run(reference_transcript(loaded, SESSION_TURNS))


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with start_cluster(tmp_path_factory.mktemp("follow-q4"), tiny_model, nodes=2, s3=True,
                       dtype="q4", engine_flags=ENGINE, kvstore_flags=KVSTORE) as c:
        yield c
