"""The default model served as shipped: SmolLM2's Q4_1 GGUF prepared with ``dtype`` q4 (its
4-bit weights kept, int4 kernels), served through the public API, answers the README's
question; its folder is about the file's size, not the float32 540 MB."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.engine.model.safetensors_files import read_header
from services.models.catalog import DEFAULT_MODEL, locate
from services.models.commands import model_folder
from tests.cluster import Cluster, start_cluster

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France? Answer in one sentence."  # README.md's


@pytest.fixture(scope="module")
def smollm2_q4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_folder(DEFAULT_MODEL, "q4", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def cluster(smollm2_q4: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with start_cluster(tmp_path_factory.mktemp("q4"), smollm2_q4, dtype="q4",
                       engine_flags={"offload.policy": "always"}) as c:
        yield c


def test_the_folder_keeps_the_4_bit_weights(smollm2_q4: Path) -> None:
    tensors = read_header(smollm2_q4 / "model.safetensors").tensors
    assert "model.layers.0.mlp.gate_proj.weight.q4codes" in tensors
    assert not any(n.endswith("proj.weight") for n in tensors)  # none in float
    size = (smollm2_q4 / "model.safetensors").stat().st_size
    assert size < 1.5 * locate(DEFAULT_MODEL).stat().st_size


def test_it_answers_the_readme_question(cluster: Cluster) -> None:
    status, answer, _ = cluster.post_with_headers(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
         "max_tokens": 24}, timeout=300)
    assert status == 200, (answer, cluster.logs())
    assert "Paris" in answer["choices"][0]["message"]["content"], answer
