"""Map Hugging Face tensor names onto LlamaModel's (fused) weights, checking every shape.

A linear weight stored quantized (quant/stored.py) becomes a quantized linear, fused like
the float ones where the kinds agree; the embedding then stays quantized too. With a
``quant`` mode (engine dtype ``q4`` / ``q8_0``) float weights are quantized at load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from .errors import LoaderError
from .hf_config import ModelConfig
from .quant import (
    Q4_SUFFIXES,
    Q8_SUFFIXES,
    Groups,
    QuantEmbedding,
    from_tensors,
    kernel_dtype,
    make_head,
    make_linear,
    quantize_int4,
    quantize_int8,
)
from .safetensors_files import SafetensorsFile


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by Hugging Face name."""
    d, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, d),
        "model.norm.weight": (d,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (q, d),
                p + "self_attn.k_proj.weight": (kv, d),
                p + "self_attn.v_proj.weight": (kv, d),
                p + "self_attn.o_proj.weight": (d, q),
                p + "mlp.gate_proj.weight": (inter, d),
                p + "mlp.up_proj.weight": (inter, d),
                p + "mlp.down_proj.weight": (d, inter),
            }
        )
        if cfg.attention_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                }
            )
        if cfg.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (d,)
        if cfg.mlp_bias:
            shapes.update(
                {
                    p + "mlp.gate_proj.bias": (inter,),
                    p + "mlp.up_proj.bias": (inter,),
                    p + "mlp.down_proj.bias": (d,),
                }
            )
    return shapes


class TensorSource:
    """Name -> tensor over several files, converted to the target dtype and device."""

    def __init__(
        self, files: list[SafetensorsFile], dtype: torch.dtype, device: torch.device,
        quant: str = "",
    ) -> None:
        self.where: dict[str, SafetensorsFile] = {}
        for f in files:
            for name in f.tensors:
                self.where[name] = f
        self.dtype = dtype
        self.device = device
        self.quant = quant  # "", "q4" or "q8_0": float weights quantized at load

    def stored_quantized(self, name: str) -> bool:
        return name + ".q4codes" in self.where or name + ".q8codes" in self.where

    @property
    def quantized(self) -> bool:
        """Whether linears are quantized (stored so, or by the load's mode)."""
        return bool(self.quant) or any(n.endswith((".q4codes", ".q8codes")) for n in self.where)

    def groups(self, name: str) -> Groups:
        """Weight ``name`` as quantized codes: as stored, or quantized now from float."""
        for suffixes in (Q4_SUFFIXES, Q8_SUFFIXES):
            if name + suffixes[0] in self.where:
                # Copies: nothing kept may view the file's mapping (see loader.own_memory).
                return from_tensors({s: self.where[name + s].tensor(name + s).to(
                    self.device, copy=True) for s in suffixes})
        w = self.where[name].tensor(name).to(self.device)
        if self.quant == "q8_0" or w.shape[1] % 32:
            return quantize_int8(w)
        return quantize_int4(w)

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        missing = [n for n in shapes if n not in self.where and not self.stored_quantized(n)]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise LoaderError(
                "weights: missing tensor(s) "
                + ", ".join(missing[:5])
                + more
                + f"; files: {sorted({str(f.path) for f in self.where.values()})}"
            )
        for name, shape in shapes.items():
            found = self._stored_shape(name)
            if found != shape:
                raise LoaderError(
                    f"weights: tensor {name!r} in {self.where[name].path} has "
                    f"shape {list(found)}, expected {list(shape)} from config.json"
                )

    def _stored_shape(self, name: str) -> tuple[int, ...]:
        if name + ".q4codes" in self.where:
            rows, half = self.where[name + ".q4codes"].tensors[name + ".q4codes"].shape
            return rows, half * 2
        if name + ".q8codes" in self.where:
            return tuple(self.where[name + ".q8codes"].tensors[name + ".q8codes"].shape)
        return tuple(self.where[name].tensors[name].shape)

    def get(self, name: str) -> torch.Tensor:
        t = self.where[name].tensor(name)
        return t.to(device=self.device, dtype=self.dtype)  # no copy when both already match

    def opt(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self.where else None


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    if all(p is None for p in parts):
        return None
    return torch.cat([p for p in parts if p is not None], dim=0)


def build_weights(
    cfg: ModelConfig, src: TensorSource
) -> tuple[dict[str, Any], Iterator[dict[str, Any]]]:
    """(global weights, per-layer weights) in LlamaModel's naming, q/k/v and gate/up fused.
    Quantized, a linear's entry is a ready quantized linear (bias inside) and the embedding
    a ``QuantEmbedding``. The layers are made one at a time as they are iterated, so a
    layer's fused copies exist only until the model has packed them (LlamaModel)."""
    src.check(expected_shapes(cfg))
    if src.quantized:
        return _quantized_weights(cfg, src)
    glob: dict[str, torch.Tensor | None] = {
        "embed": src.get("model.embed_tokens.weight"),
        "norm": src.get("model.norm.weight"),
        "lm_head": None if cfg.tie_word_embeddings else src.get("lm_head.weight"),
    }
    return glob, _float_layers(cfg, src)


def _float_layers(cfg: ModelConfig, src: TensorSource) -> Iterator[dict[str, Any]]:
    for i in range(cfg.num_layers):
        a = f"model.layers.{i}.self_attn."
        m = f"model.layers.{i}.mlp."
        yield (
            {
                "input_norm": src.get(f"model.layers.{i}.input_layernorm.weight"),
                "post_norm": src.get(f"model.layers.{i}.post_attention_layernorm.weight"),
                "qkv_w": _cat(
                    [
                        src.get(a + "q_proj.weight"),
                        src.get(a + "k_proj.weight"),
                        src.get(a + "v_proj.weight"),
                    ]
                ),
                "qkv_b": _cat(
                    [
                        src.opt(a + "q_proj.bias"),
                        src.opt(a + "k_proj.bias"),
                        src.opt(a + "v_proj.bias"),
                    ]
                )
                if cfg.attention_bias
                else None,
                "o_w": src.get(a + "o_proj.weight"),
                "o_b": src.get(a + "o_proj.bias") if cfg.o_proj_bias else None,
                "gate_up_w": _cat([src.get(m + "gate_proj.weight"), src.get(m + "up_proj.weight")]),
                "gate_up_b": _cat([src.get(m + "gate_proj.bias"), src.get(m + "up_proj.bias")])
                if cfg.mlp_bias
                else None,
                "down_w": src.get(m + "down_proj.weight"),
                "down_b": src.get(m + "down_proj.bias") if cfg.mlp_bias else None,
            }
        )


def _quantized_weights(
    cfg: ModelConfig, src: TensorSource
) -> tuple[dict[str, Any], Iterator[dict[str, Any]]]:
    act, widen = kernel_dtype(src.dtype), src.quant == "q8_0"

    def lin(names: list[str], biases: list[str] | None) -> Any:
        b = _cat([src.get(n) for n in biases]) if biases else None
        return make_linear([src.groups(n) for n in names], b, act, widen)

    embed = QuantEmbedding(src.groups("model.embed_tokens.weight"), src.dtype)
    head = make_head([embed.groups()] if cfg.tie_word_embeddings
                     else [src.groups("lm_head.weight")], None, act, widen)
    glob = {"embed": embed, "norm": src.get("model.norm.weight"), "lm_head": head}
    return glob, _quantized_layers(cfg, src, lin)


def _quantized_layers(cfg: ModelConfig, src: TensorSource,
                      lin: Callable[[list[str], list[str] | None], Any]
                      ) -> Iterator[dict[str, Any]]:
    for i in range(cfg.num_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv = [a + "q_proj", a + "k_proj", a + "v_proj"]
        yield {
            "input_norm": src.get(p + "input_layernorm.weight"),
            "post_norm": src.get(p + "post_attention_layernorm.weight"),
            "qkv_w": lin([n + ".weight" for n in qkv],
                         [n + ".bias" for n in qkv] if cfg.attention_bias else None),
            "o_w": lin([a + "o_proj.weight"], [a + "o_proj.bias"] if cfg.o_proj_bias else None),
            "gate_up_w": lin([m + "gate_proj.weight", m + "up_proj.weight"],
                             [m + "gate_proj.bias", m + "up_proj.bias"] if cfg.mlp_bias
                             else None),
            "down_w": lin([m + "down_proj.weight"],
                          [m + "down_proj.bias"] if cfg.mlp_bias else None),
            "qkv_b": None, "o_b": None, "gate_up_b": None, "down_b": None,
        }
