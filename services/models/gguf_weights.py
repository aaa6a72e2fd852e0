"""A GGUF file's tensors as a served folder's weights, quantized ones kept quantized.

    GGUF tensor (ggml name, type, raw blocks) ──ggml_blocks.decode_*──► codes + group scales
        ──rows un-permuted (Llama q/k)──► model.safetensors in quant/stored.py's layout

4-bit types (Q4_0, Q4_1, Q4_K) keep their codes exactly, as do Q8_0 and Q6_K (in 8-bit);
float tensors (norms stay float) are quantized for the serving dtype (``q4``: 4-bit
per 32 columns, ``q8_0``: 8-bit per row); other ggml types (Q5_x, Q2_K, Q3_K, Q5_K) are
dequantized by the ``gguf`` package and re-quantized the same way. Nothing is dequantized
to float32 on the way for the kept types, so preparing takes seconds and the folder is
about the size of the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.engine.model.quant import (
    EIGHT_BIT,
    FOUR_BIT,
    Groups,
    Int4Groups,
    Int8Groups,
    decode_int4,
    decode_int8,
    quantize_int4,
    quantize_int8,
    to_tensors,
)

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_F32, _F16, _BF16 = 0, 1, 30
# llama.cpp's converter interleaves the rotary halves of q and k rows for these families
# (its ``LlamaModel.permute``); the engine's rotary embedding wants Hugging Face's order.
_PERMUTED = ("llama", "mistral")


def hf_name(name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for a
    tensor the engine does not use (``rope_freqs``: config.json has the rope scaling)."""
    base, _, kind = name.rpartition(".")
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{kind}"
    return None


def rope_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes the converter's interleave: Hugging Face's row (head h,
    half t, j) is the file's row (h, j, t).  # (heads, head_dim/2, 2) -> (heads, 2, hd/2)"""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def _take_rows(q: Groups, order: torch.Tensor) -> Groups:
    if isinstance(q, Int4Groups):
        return Int4Groups(q.codes[order], q.scale[order], q.min[order], q.group)
    return Int8Groups(q.codes[order], q.scale[order], q.group)


def _float(t: Any, rows: int, cols: int) -> torch.Tensor:
    kind = int(t.tensor_type)
    data = np.asarray(t.data)
    if kind == _BF16:
        return torch.from_numpy(data.copy()).view(torch.bfloat16).reshape(rows, cols).float()
    if kind in (_F32, _F16):
        return torch.from_numpy(data.astype(np.float32)).reshape(rows, cols)
    from gguf.quants import dequantize  # the package's reference for the other ggml types

    return torch.from_numpy(dequantize(data, t.tensor_type).astype(np.float32)).reshape(rows, cols)


def convert_tensor(t: Any, dtype: str) -> Groups | torch.Tensor:
    """One GGUF tensor: codes (kept or quantized for ``dtype``), or float32 if 1-D."""
    kind = int(t.tensor_type)
    cols = int(t.shape[0])
    rows = int(t.n_elements) // cols
    if rows == 1 or len(t.shape) == 1:
        return _float(t, 1, cols).reshape(cols)
    if kind in FOUR_BIT:
        return decode_int4(torch.from_numpy(np.asarray(t.data).copy()), kind, rows, cols)
    if kind in EIGHT_BIT:
        return decode_int8(torch.from_numpy(np.asarray(t.data).copy()), kind, rows, cols)
    w = _float(t, rows, cols)
    return quantize_int4(w) if dtype == "q4" and cols % 32 == 0 else quantize_int8(w)


def quantized_state(gguf: Path, family: str, config: dict[str, Any],
                    dtype: str) -> dict[str, torch.Tensor]:
    """Every tensor the engine needs from ``gguf``, by Hugging Face name, in the stored
    layout (``config`` is the folder's config.json: head counts for the row order)."""
    from gguf import GGUFReader

    heads = {"self_attn.q_proj": int(config["num_attention_heads"]),
             "self_attn.k_proj": int(config.get("num_key_value_heads")
                                     or config["num_attention_heads"])}
    out: dict[str, torch.Tensor] = {}
    for t in GGUFReader(str(gguf)).tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        value = convert_tensor(t, dtype)
        proj = next((p for p in heads if f".{p}." in name), None)
        if family in _PERMUTED and proj is not None:
            rows = int(value.shape[0] if isinstance(value, torch.Tensor) else value.codes.shape[0])
            order = rope_rows(rows, heads[proj])
            value = value[order] if isinstance(value, torch.Tensor) else _take_rows(value, order)
        out.update({name: value.contiguous()} if isinstance(value, torch.Tensor)
                   else to_tensors(name, value))
    return out
