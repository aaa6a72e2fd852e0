"""The tensors a Llama-family engine computes with, and the checkpoint tensors each is
made of (torch-free: the nodemgr's Reuse Store plans with it, the engine fills by it).

The engine fuses q/k/v into one projection and gate/up into one (see the engine's
``model/llama.py``): an engine tensor is its parts concatenated along dim 0, converted to
the serving dtype. Names are the engine's own (``embed``, ``layers.3.qkv_w``...).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class EngineTensor:
    name: str
    parts: tuple[str, ...]  # checkpoint tensor names, concatenated along dim 0
    shape: tuple[int, ...]

    def nbytes(self, dtype: str) -> int:
        n = DTYPE_BYTES[dtype]
        for d in self.shape:
            n *= d
        return n


_LAYER = (  # engine name, checkpoint names (relative to model.layers.<i>.)
    ("input_norm", ("input_layernorm.weight",)),
    ("post_norm", ("post_attention_layernorm.weight",)),
    ("qkv_w", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
               "self_attn.v_proj.weight")),
    ("qkv_b", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")),
    ("o_w", ("self_attn.o_proj.weight",)),
    ("o_b", ("self_attn.o_proj.bias",)),
    ("gate_up_w", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("gate_up_b", ("mlp.gate_proj.bias", "mlp.up_proj.bias")),
    ("down_w", ("mlp.down_proj.weight",)),
    ("down_b", ("mlp.down_proj.bias",)),
)


def engine_tensors(shapes: Mapping[str, Sequence[int]], num_layers: int,
                   tie_word_embeddings: bool) -> list[EngineTensor]:
    """The engine tensors of a checkpoint whose tensors have ``shapes`` (by name). An
    optional tensor (a bias) whose parts are absent is left out; KeyError names a
    required one that is missing."""
    out = [_one("embed", ("model.embed_tokens.weight",), shapes),
           _one("norm", ("model.norm.weight",), shapes)]
    if not tie_word_embeddings:
        out.append(_one("lm_head", ("lm_head.weight",), shapes))
    for i in range(num_layers):
        for name, parts in _LAYER:
            full = tuple(f"model.layers.{i}.{p}" for p in parts)
            if name.endswith("_b") and not all(p in shapes for p in full):
                continue
            out.append(_one(f"layers.{i}.{name}", full, shapes))
    return out


def _one(name: str, parts: tuple[str, ...], shapes: Mapping[str, Sequence[int]]
         ) -> EngineTensor:
    dims = [tuple(shapes[p]) for p in parts]
    rows = sum(d[0] for d in dims) if dims[0] else 0
    return EngineTensor(name, parts, (rows, *dims[0][1:]) if dims[0] else ())
