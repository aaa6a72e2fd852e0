"""ModelConfig: the part of a Hugging Face ``config.json`` a Llama-family decoder needs.

Both spellings of RoPE settings are accepted: the classic ``rope_theta`` + ``rope_scaling``
keys and the ``rope_parameters`` dict written by transformers 5.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .errors import LoaderError

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2 always; Llama if attention_bias)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    o_proj_bias: bool = False  # Llama's attention_bias also puts a bias on o_proj
    mlp_bias: bool = False
    # Mistral-style sliding window as declared; the usable context is capped at it instead
    # of implementing windowed attention (max_position_embeddings is already the cap).
    sliding_window: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any], extra_eos: tuple[int, ...] = ()) -> ModelConfig:
        """Validate a parsed config.json; raises LoaderError naming the bad key."""
        arch = _architecture(raw)
        try:
            hidden = _int(raw, "hidden_size")
            heads = _int(raw, "num_attention_heads")
            kv_heads = int(raw.get("num_key_value_heads") or heads)
            head_dim = int(raw.get("head_dim") or hidden // heads)
            theta, scaling = _rope(raw)
            max_pos = _int(raw, "max_position_embeddings")
            window = _sliding_window(raw, arch)
            if window is not None and window < max_pos:
                log.info(
                    "sliding_window=%s < max_position_embeddings=%s: context capped at %s",
                    window,
                    max_pos,
                    window,
                )
                max_pos = window
            is_qwen2 = arch == "Qwen2ForCausalLM"
            llama_bias = bool(raw.get("attention_bias", False)) and not is_qwen2
            cfg = cls(
                architecture=arch,
                vocab_size=_int(raw, "vocab_size"),
                hidden_size=hidden,
                num_layers=_int(raw, "num_hidden_layers"),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                intermediate_size=_int(raw, "intermediate_size"),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=max_pos,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=is_qwen2 or llama_bias,
                bos_token_id=_opt_int(raw.get("bos_token_id")),
                eos_token_ids=_merge_ids(extra_eos, _ids(raw.get("eos_token_id"))),
                o_proj_bias=llama_bias,
                mlp_bias=bool(raw.get("mlp_bias", False)) and not is_qwen2,
                sliding_window=window,
            )
        except (TypeError, ValueError) as exc:
            raise LoaderError(f"config.json: malformed value: {exc}") from exc
        cfg._check()
        return cfg

    def _check(self) -> None:
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise LoaderError(
                f"config.json: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        for key in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
        ):
            if getattr(self, key) <= 0:
                raise LoaderError(f"config.json: {key} must be positive, got {getattr(self, key)}")
        if self.head_dim % 2:
            raise LoaderError(f"config.json: head_dim={self.head_dim} must be even for RoPE")


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise LoaderError(
            "config.json: no 'architectures' list; expected one of "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    arch = str(archs[0])
    if arch not in SUPPORTED_ARCHITECTURES:
        raise LoaderError(
            f"config.json: unsupported architecture {arch!r}; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise LoaderError(f"config.json: hidden_act={act!r} is not supported (only 'silu')")
    return arch


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling: dict[str, Any] | None = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = raw.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise LoaderError(f"config.json: rope_scaling must be an object, got {scaling!r}")
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise LoaderError(
                f"config.json: rope_type {rope_type!r} is not supported; supported: "
                + ", ".join(SUPPORTED_ROPE_TYPES)
            )
        if rope_type == "default":
            scaling = None
        else:
            scaling = dict(scaling, rope_type=rope_type)
    return theta, scaling


def _sliding_window(raw: dict[str, Any], arch: str) -> int | None:
    window = raw.get("sliding_window")
    if window is None:
        return None
    if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        return None
    return int(window)


def _int(raw: dict[str, Any], key: str) -> int:
    if key not in raw or raw[key] is None:
        raise LoaderError(f"config.json: missing required key {key!r}")
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise LoaderError(f"config.json: {key} must be an integer, got {value!r}")
    return int(value)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return (int(value),)


def _merge_ids(*groups: tuple[int, ...]) -> tuple[int, ...]:
    out: list[int] = []
    for group in groups:
        out.extend(i for i in group if i not in out)
    return tuple(out)


def eos_ids_from_generation_config(raw: dict[str, Any]) -> tuple[int, ...]:
    return _ids(raw.get("eos_token_id"))
