"""Loader: errors name the file/tensor and the defect; sharded folders; fingerprint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.engine.model import LoaderError, load_model, write_demo_model


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder: Path, **changes: object) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(LoaderError, match="does not exist"):
        load_model(tmp_path / "nope")


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_missing_file_names_the_path(demo_tiny: Path, tmp_path: Path, name: str) -> None:
    folder = _copy(demo_tiny, tmp_path / "m")
    (folder / name).unlink()
    with pytest.raises(LoaderError, match=rf"{name}.*missing"):
        load_model(folder)


def test_missing_weights(demo_tiny: Path, tmp_path: Path) -> None:
    folder = _copy(demo_tiny, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(LoaderError, match=r"no \*\.safetensors"):
        load_model(folder)


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json",
                                  "generation_config.json"])
def test_malformed_json(demo_tiny: Path, tmp_path: Path, name: str) -> None:
    folder = _copy(demo_tiny, tmp_path / "m")
    (folder / name).write_text('{"vocab_size": 12,')
    with pytest.raises(LoaderError, match=rf"{name}: malformed JSON"):
        load_model(folder)


def test_bad_tokenizer_json(demo_tiny: Path, tmp_path: Path) -> None:
    folder = _copy(demo_tiny, tmp_path / "m")
    (folder / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(LoaderError, match="tokenizer.json: cannot parse"):
        load_model(folder)


def test_unsupported_architecture(demo_tiny: Path, tmp_path: Path) -> None:
    folder = _copy(demo_tiny, tmp_path / "m")
    _edit_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(LoaderError) as err:
        load_model(folder)
    msg = str(err.value)
    assert "GPT2LMHeadModel" in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert arch in msg


@pytest.mark.parametrize(("change", "pattern"), [
    ({"hidden_size": None}, "missing required key 'hidden_size'"),
    ({"num_hidden_layers": "two"}, "num_hidden_layers must be an integer"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not supported"),
])
def test_bad_config_values(demo_tiny: Path, tmp_path: Path, change: dict, pattern: str) -> None:
    folder = _copy(demo_tiny, tmp_path / "m")
    _edit_config(folder, **change)
    with pytest.raises(LoaderError, match=pattern):
        load_model(folder)


def test_shape_mismatch_names_tensor_and_shapes(demo_tiny: Path, tmp_path: Path) -> None:
    folder = _copy(demo_tiny, tmp_path / "m")
    _edit_config(folder, intermediate_size=200)
    with pytest.raises(LoaderError) as err:
        load_model(folder)
    msg = str(err.value)
    assert "model.layers.0.mlp.gate_proj.weight" in msg
    assert "[192, 64]" in msg and "expected [200, 64]" in msg


def test_missing_tensor_named(demo_tiny: Path, tmp_path: Path) -> None:
    folder = _copy(demo_tiny, tmp_path / "m")
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.self_attn.v_proj.weight"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(LoaderError, match=r"missing tensor\(s\) model\.layers\.1\.self_attn"
                                          r"\.v_proj\.weight"):
        load_model(folder)


def test_truncated_weights_file(demo_tiny: Path, tmp_path: Path) -> None:
    folder = _copy(demo_tiny, tmp_path / "m")
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(LoaderError, match="outside the file"):
        load_model(folder)


def _shard(folder: Path) -> None:
    """Split model.safetensors into two shards with an index, as transformers does."""
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: weights[n] for n in part}, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_loads_same_logits(demo_tiny: Path, tmp_path: Path) -> None:
    from .paged import PagedCache

    folder = _copy(demo_tiny, tmp_path / "m")
    _shard(folder)
    sharded = load_model(folder, dtype=torch.float32)
    single = load_model(demo_tiny, dtype=torch.float32)
    for (name, x), (_, y) in zip(sharded.model.named_parameters(),
                                 single.model.named_parameters(), strict=True):
        assert torch.equal(x, y), name
    for la, lb in zip(sharded.model.linears(), single.model.linears(), strict=True):
        assert torch.equal(la.weight, lb.weight)  # packed ones are not parameters
    prompt = single.tokenizer.encode_prompt("The quick brown fox")
    a = PagedCache(sharded.model, 1, 16).step([prompt], [0])
    b = PagedCache(single.model, 1, 16).step([prompt], [0])
    # Same weights; only memory alignment (SIMD reduction order) may differ.
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_index_pointing_to_missing_shard(demo_tiny: Path, tmp_path: Path) -> None:
    folder = _copy(demo_tiny, tmp_path / "m")
    _shard(folder)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(LoaderError, match="model-00002-of-00002.safetensors"):
        load_model(folder)


def test_bf16_weights_are_mapped_not_copied(demo_tiny: Path, tmp_path: Path) -> None:
    folder = _copy(demo_tiny, tmp_path / "m")
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(folder / "model.safetensors").items()}
    save_file(weights, folder / "model.safetensors")
    loaded = load_model(folder, dtype=torch.bfloat16)
    embed = loaded.model.embed
    # A view into the file mapping: its storage is the whole file, not just this tensor.
    assert embed.untyped_storage().nbytes() == (folder / "model.safetensors").stat().st_size
    assert torch.equal(embed, weights["model.embed_tokens.weight"])


def test_fingerprint_stable_and_sensitive(demo_tiny: Path, tmp_path: Path) -> None:
    a = load_model(demo_tiny, dtype=torch.float32)
    assert a.fingerprint == load_model(demo_tiny, dtype=torch.float32).fingerprint
    assert len(a.fingerprint) == 64 and int(a.fingerprint, 16) >= 0
    assert load_model(demo_tiny, dtype=torch.bfloat16).fingerprint != a.fingerprint
    folder = _copy(demo_tiny, tmp_path / "m")
    _edit_config(folder, rms_norm_eps=1e-6)
    assert load_model(folder, dtype=torch.float32).fingerprint != a.fingerprint
    other = _copy(demo_tiny, tmp_path / "n")
    weights = load_file(other / "model.safetensors")
    weights["extra.rotary_emb.inv_freq"] = torch.zeros(8)  # unused extras are ignored...
    save_file(weights, other / "model.safetensors")
    loaded = load_model(other, dtype=torch.float32)
    assert loaded.fingerprint != a.fingerprint  # ...but the file is not the same model file


def test_served_name_and_metadata(demo_tiny: Path) -> None:
    loaded = load_model(demo_tiny, dtype=torch.float32)
    assert loaded.name == demo_tiny.name
    assert load_model(demo_tiny, served_name="demo").name == "demo"
    assert loaded.config.eos_token_ids == (1, 4)
    assert loaded.tokenizer.eos_token_ids[:2] == (1, 4)
    assert loaded.path == demo_tiny and loaded.dtype == torch.float32


def test_mistral_sliding_window_caps_context(demo_tiny: Path, tmp_path: Path) -> None:
    folder = _copy(demo_tiny, tmp_path / "m")
    _edit_config(folder, architectures=["MistralForCausalLM"], model_type="mistral",
                 sliding_window=1024)
    loaded = load_model(folder, dtype=torch.float32)
    assert loaded.config.architecture == "MistralForCausalLM"
    assert loaded.config.max_position_embeddings == 1024
    assert loaded.config.sliding_window == 1024


def test_fine_tunes_of_one_base_have_different_fingerprints(tmp_path: Path) -> None:
    # Same config, tokenizer and safetensors header (names, shapes, offsets): only the
    # bytes differ, and KV made by one must never serve the other.
    a = write_demo_model(tmp_path / "a", "tiny", seed=1, base_seed=0, share=0.5)
    b = write_demo_model(tmp_path / "b", "tiny", seed=2, base_seed=0, share=0.5)
    fa = load_model(a, dtype=torch.float32).fingerprint
    fb = load_model(b, dtype=torch.float32).fingerprint
    assert fa != fb


def _rss_file_kib() -> int | None:
    """Resident pages of file mappings (Linux), or None where /proc does not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssFile:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def test_dropped_file_pages_leave_rss_and_read_back(tmp_path: Path) -> None:
    from services.engine.model.safetensors_files import read_header

    w = torch.arange(8 << 20, dtype=torch.float32)  # 32 MiB
    save_file({"w": w}, tmp_path / "m.safetensors")
    f = read_header(tmp_path / "m.safetensors")
    t = f.tensor("w")
    before = _rss_file_kib()
    assert before is not None, "/proc/self/status has no RssFile (Linux 4.5 and later do)"
    assert torch.equal(t, w)  # every page read through the mapping
    touched = _rss_file_kib()
    assert touched is not None and touched - before > 24 << 10
    f.drop_pages()
    dropped = _rss_file_kib()
    assert dropped is not None and touched - dropped > 24 << 10
    assert torch.equal(t, w)  # the view reads its pages back from the page cache


def test_layers_are_built_and_packed_one_at_a_time(demo_tiny: Path) -> None:
    """The loader's per-layer hook runs after each layer is packed and before the next
    layer's weights are made: the load never holds every layer's fused copies at once."""
    from services.engine.model.llama import LlamaModel
    from services.engine.model.loader import read_config
    from services.engine.model.safetensors_files import read_header, weight_files
    from services.engine.model.weights import TensorSource, build_weights

    cfg, _ = read_config(demo_tiny)
    files = [read_header(p) for p in weight_files(demo_tiny)]
    glob, layers = build_weights(cfg, TensorSource(files, torch.float32, torch.device("cpu")))
    made = 0

    def counted():  # type: ignore[no-untyped-def]
        nonlocal made
        for w in layers:
            made += 1
            yield w

    hooks: list[int] = []
    model = LlamaModel(cfg, glob, counted(), after_layer=lambda _: hooks.append(made))
    assert hooks == list(range(1, cfg.num_layers + 1))
    ref = load_model(demo_tiny, dtype=torch.float32)
    for a, b in zip(model.linears(), ref.model.linears(), strict=True):
        assert torch.equal(a.weight, b.weight)
