"""Map Hugging Face tensor names onto LlamaModel's (fused) weights, checking every shape."""

from __future__ import annotations

import torch

from .errors import LoaderError
from .hf_config import ModelConfig
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
        self, files: list[SafetensorsFile], dtype: torch.dtype, device: torch.device
    ) -> None:
        self.where: dict[str, SafetensorsFile] = {}
        for f in files:
            for name in f.tensors:
                self.where[name] = f
        self.dtype = dtype
        self.device = device

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        missing = [n for n in shapes if n not in self.where]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise LoaderError(
                "weights: missing tensor(s) "
                + ", ".join(missing[:5])
                + more
                + f"; files: {sorted({str(f.path) for f in self.where.values()})}"
            )
        for name, shape in shapes.items():
            found = self.where[name].tensors[name].shape
            if found != shape:
                raise LoaderError(
                    f"weights: tensor {name!r} in {self.where[name].path} has "
                    f"shape {list(found)}, expected {list(shape)} from config.json"
                )

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
) -> tuple[dict[str, torch.Tensor | None], list[dict[str, torch.Tensor | None]]]:
    """(global weights, per-layer weights) in LlamaModel's naming, q/k/v and gate/up fused."""
    src.check(expected_shapes(cfg))
    glob: dict[str, torch.Tensor | None] = {
        "embed": src.get("model.embed_tokens.weight"),
        "norm": src.get("model.norm.weight"),
        "lm_head": None if cfg.tie_word_embeddings else src.get("lm_head.weight"),
    }
    layers = []
    for i in range(cfg.num_layers):
        a = f"model.layers.{i}.self_attn."
        m = f"model.layers.{i}.mlp."
        layers.append(
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
    return glob, layers
