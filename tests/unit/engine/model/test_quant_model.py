"""A whole tiny Llama written as a GGUF file of each kept type (llama.cpp's tensor names and
q/k row order), prepared into a served folder by services/models/gguf_weights.py and run
with its weights kept quantized, against the same model with the GGUF's weights
dequantized by the ``gguf`` package into a float32 folder."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from services.engine.model import load_model
from services.engine.model.quant import (
    NAMES,
    Q4_0,
    Q4_1,
    Q4_K,
    Q6_K,
    Q8_0,
    Int4Linear,
    kernel_dtype,
)
from services.models.gguf_weights import quantized_state, rope_rows

from .paged import PagedCache, greedy
from .test_quant_blocks import random_blocks

GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
              "lm_head": "output", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2}


def gguf_name(hf: str) -> str:
    base, _, kind = hf.rpartition(".")
    if base in GGUF_NAMES:
        return f"{GGUF_NAMES[base]}.{kind}"
    _, _, layer, *rest = base.split(".")
    return f"blk.{layer}.{GGUF_NAMES['.'.join(rest)]}.{kind}"


def write_gguf(folder: Path, kind: int, path: Path, config: dict) -> dict[str, torch.Tensor]:
    """``folder``'s model as a GGUF of ``kind`` (K-types: random blocks, as no encoder is at
    hand); returns the file's weights dequantized, by Hugging Face name and row order."""
    state = load_file(str(folder / "model.safetensors"))
    writer = GGUFWriter(str(path), "llama")
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    ref = {}
    for i, (name, w) in enumerate(sorted(state.items())):
        proj = next((p for p in heads if f".{p}." in name), None)
        order = rope_rows(w.shape[0], heads[proj]) if proj else None
        if w.dim() == 1:
            writer.add_tensor(gguf_name(name), w.float().numpy())
            ref[name] = w.float()
            continue
        n, k = w.shape
        qtype = GGMLQuantizationType(kind)
        if kind in (Q4_K, Q6_K):
            raw = random_blocks(kind, n, k, seed=i)
            raw[:, :] = _small_scales(raw, kind)
        else:
            file_rows = torch.empty_like(w)
            if order is not None:  # llama.cpp's interleave: the file's row of HF row r
                file_rows[order] = w
            else:
                file_rows = w
            raw = quantize(file_rows.float().numpy(), qtype)
        writer.add_tensor(gguf_name(name), raw, raw_dtype=qtype)
        deq = torch.from_numpy(np.asarray(dequantize(raw, qtype), np.float32)).reshape(n, k)
        ref[name] = deq[order] if order is not None else deq
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return ref


def _small_scales(raw: np.ndarray, kind: int) -> np.ndarray:
    """Random K-blocks with fp16 scales small enough for a sane model (|w| < ~0.1)."""
    size = 144 if kind == Q4_K else 210
    b = raw.reshape(-1, size).copy()
    rng = np.random.default_rng(0)
    for at in ((0, 2) if kind == Q4_K else (208,)):
        d = (rng.random(b.shape[0]) * 1e-4 + 2e-5).astype(np.float16)
        b[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return b.reshape(raw.shape)


@pytest.fixture
def quantized_pair(tmp_path: Path, hf_checkpoint: Callable[..., tuple[Path, object]]):
    def make(kind: int, dtype: str = "q4") -> tuple[Path, Path]:
        folder, model = hf_checkpoint("llama", **SHAPE)
        config = model.config.to_dict()  # type: ignore[attr-defined]
        gguf = tmp_path / f"tiny-{NAMES[kind]}.gguf"
        ref = write_gguf(folder, kind, gguf, config)
        served, dense = tmp_path / f"q-{NAMES[kind]}", tmp_path / f"f-{NAMES[kind]}"
        for out in (served, dense):
            shutil.copytree(folder, out)
            (out / "model.safetensors").unlink()
        save_file(quantized_state(gguf, "llama", config, dtype),
                  str(served / "model.safetensors"))
        save_file({k: v.contiguous() for k, v in ref.items()}, str(dense / "model.safetensors"))
        return served, dense
    return make


@pytest.mark.parametrize("kind", [Q4_0, Q4_1, Q4_K, Q8_0, Q6_K], ids=NAMES.get)
def test_a_tiny_gguf_of_each_type_serves_quantized(quantized_pair, kind: int) -> None:
    served, dense = quantized_pair(kind)
    q = load_model(served, dtype=torch.float32)
    f = load_model(dense, dtype=torch.float32)
    assert q.model.quant_embed is not None  # nothing was dequantized to float at load
    if kind in (Q4_0, Q4_1, Q4_K):
        assert isinstance(q.model.decoder_layers[0].qkv, Int4Linear)
    prompt = list(range(5, 40))
    lq = PagedCache(q.model, 1, 64).step([prompt], [0])
    lf = PagedCache(f.model, 1, 64).step([prompt], [0])
    # 4-bit types: the same weights (float32 rounding only); 8-bit ones re-rounded per row;
    # on a CPU with native bf16 the kernels compute in it (scales and inputs rounded)
    tol = 2e-3 if kind in (Q4_0, Q4_1, Q4_K) else 5e-2
    if kernel_dtype(torch.float32) == torch.bfloat16:
        tol = 5e-2 if kind in (Q4_0, Q4_1, Q4_K) else 1e-1
    assert (lq - lf).abs().max().item() <= tol * max(1.0, lf.abs().max().item())
    # served step by step (decode after prefill) it continues as prefilling everything does
    out = greedy(q.model, prompt, 6)
    again = PagedCache(q.model, 1, 64).step([prompt + out[:-1]], [0])
    assert int(again[0].argmax()) == out[-1]
    assert q.fingerprint != f.fingerprint


def test_q8_0_widens_4_bit_weights_and_float_folders_quantize_at_load(quantized_pair) -> None:
    served, dense = quantized_pair(Q4_1)
    wide = load_model(served, dtype=torch.float32, quant="q8_0")
    assert not isinstance(wide.model.decoder_layers[0].qkv, Int4Linear)
    at_load = load_model(dense, dtype=torch.float32, quant="q4")
    plain = load_model(dense, dtype=torch.float32)
    assert at_load.model.quant_embed is not None and plain.model.quant_embed is None
    assert at_load.fingerprint != plain.fingerprint
    prompt = list(range(3, 20))
    assert len(greedy(at_load.model, prompt, 4)) == 4
