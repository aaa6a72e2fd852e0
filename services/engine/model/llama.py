"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a paged, per-layer KV pool.

Weights are held fused where that saves matmul calls: q/k/v become one (q+2kv, hidden)
projection and gate/up one (2*intermediate, hidden); the arithmetic is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, overload

import torch
import torch.nn.functional as F
from torch import nn

from ..forward_batch import ForwardBatch
from .decode_step import DecodeStep
from .hf_config import ModelConfig
from .linear import Linear, default_upcast_rows
from .paged_attention import (
    AttentionPlan,
    build_plan,
    build_rows_plan,
    paged_attention,
    write_kv,
)
from .quant import QuantEmbedding, QuantLinear
from .rope import RotaryTables, apply_rotary


@overload
def _param(t: torch.Tensor) -> nn.Parameter: ...
@overload
def _param(t: None) -> None: ...
def _param(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t, requires_grad=False)


def _required(w: Mapping[str, torch.Tensor | None], key: str) -> nn.Parameter:
    t = w[key]
    if t is None:
        raise ValueError(f"the checkpoint has no {key!r} weight")
    return _param(t)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == weight.dtype == torch.float32:
        # One call, the same operations in the same order as below: x * rsqrt(mean(x^2) +
        # eps), times the weight. A norm costs ~15 us of dispatch on CPU this way, ~26 the
        # other; a tiny model's decode step runs five to nine of them.
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)
    # Normalise in float32 and scale in the model dtype, as the reference implementation.
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * y.to(x.dtype)


@dataclass
class OutputRows:
    """The rows a step needs the last layer's output at, and their attention plan."""
    index: torch.Tensor  # (R,) packed rows
    plan: AttentionPlan  # build_rows_plan for those rows


def _linear(w: Mapping[str, Any], key: str) -> Linear | QuantLinear | None:
    """A quantized linear given ready-made in the weights (None for a float weight)."""
    t = w[key]
    return None if t is None or isinstance(t, torch.Tensor) else t


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, w: dict[str, Any], upcast_rows: int) -> None:
        super().__init__()
        self.upcast_rows = upcast_rows
        self.eps = config.rms_norm_eps
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.heads = config.num_heads
        self.kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.input_norm = _required(w, "input_norm")
        self.post_norm = _required(w, "post_norm")
        # Quantized linears come ready-made (quant/build.py) and hold their own weights.
        self.qkv: Linear | QuantLinear
        self.o: Linear | QuantLinear
        self.gate_up: Linear | QuantLinear
        self.down: Linear | QuantLinear
        for name in ("qkv", "o", "gate_up", "down"):
            ready = _linear(w, name + "_w")
            if ready is not None:
                setattr(self, name + "_w", None)
                setattr(self, name + "_b", None)
                setattr(self, name, ready)
                continue
            weight, bias = _required(w, name + "_w"), _param(w[name + "_b"])
            setattr(self, name + "_w", weight)
            setattr(self, name + "_b", bias)
            # A view over the parameters above that also keeps their float32 copies.
            setattr(self, name, Linear(weight, bias))

    def linears(self) -> tuple[Linear, ...]:
        """The float linears (quantized ones have no float copies or packing)."""
        return tuple(lin for lin in (self.qkv, self.o, self.gate_up, self.down)
                     if isinstance(lin, Linear))

    def pack_linears(self) -> None:
        """Small float32 weights on MKL, other float32 CPU weights in oneDNN's layout (see
        linear.py), each in anonymous memory: a packed weight's parameter is dropped, a
        small one's replaced by its copy, so the plain one is freed."""
        for name, lin in (("qkv_w", self.qkv), ("o_w", self.o), ("gate_up_w", self.gate_up),
                          ("down_w", self.down)):
            if not isinstance(lin, Linear):
                continue
            if lin.choose_kernel():
                setattr(self, name, _param(lin.w))  # its copy (see Linear.choose_kernel)
            elif lin.pack():
                setattr(self, name, None)

    def forward(
        self,
        h: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        plan: AttentionPlan,
        kv_cache: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out_rows: OutputRows | None = None,
        decode: DecodeStep | None = None,
    ) -> torch.Tensor:
        """``out_rows``: compute the layer's output only at these rows (its K/V still for
        every row); the result then has one row per ``out_rows.index``. ``decode``: the
        step's all-decode attention (decode_step.py), in place of ``plan``'s."""
        t = h.shape[0]
        x = rms_norm(h, self.input_norm, self.eps)
        qkv = self.qkv(x, self.upcast_rows)  # (T, q + 2kv)
        qk, v = qkv.split((self.q_size + self.kv_size, self.kv_size), dim=-1)
        # q and k heads rotated in one go: (T, heads + kv_heads, hd)
        qk = apply_rotary(qk.view(t, self.heads + self.kv_heads, self.head_dim), cos, sin)
        q, k = qk.split((self.heads, self.kv_heads), dim=1)
        v = v.view(t, self.kv_heads, self.head_dim)
        if batch.wait_for_layer is not None:
            batch.wait_for_layer(layer)  # reused KV of this layer must be resident first
        if decode is not None:
            attn = decode.attend(layer, q, k, v, self.scale)
        else:
            write_kv(kv_cache, plan.kv_rows[layer], k, v)
            if out_rows is not None:
                q, h, plan = q[out_rows.index], h[out_rows.index], out_rows.plan
            attn = paged_attention(plan, q, kv_cache, batch.block_tables[layer], self.scale)
        h = h + self.o(attn, self.upcast_rows)
        x = rms_norm(h, self.post_norm, self.eps)
        gate, up = self.gate_up(x, self.upcast_rows).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up, self.upcast_rows)


class LayerSource(Protocol):
    """Where the forward gets layers it does not hold resident (engine/remap/: a remapped
    layer computed in a slot its weights are streamed into)."""

    def acquire(self, layer: int) -> DecoderLayer: ...

    def release(self, layer: int) -> None: ...


class LlamaModel(nn.Module):
    """forward(batch, kv_cache) -> float32 logits (num_seqs, vocab) at batch.logits_indices."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, Any],
        layers: Iterable[dict[str, Any]],
        own_weights: bool = True,
        after_layer: Callable[[DecoderLayer], None] | None = None,
    ) -> None:
        """``own_weights``: False when the weights are views into the node's shared weight
        arena (``mapped.py``): they are computed on as they are, never packed or copied.
        ``layers`` is consumed one at a time: each layer's float linears are packed before
        the next is read, then ``after_layer(layer)`` runs (the loader drops the file pages
        read so far), so a load holds one layer's transient copies, not the model's."""
        super().__init__()
        self.config = config
        # All-decode steps in one length group take decode_step.py's path (the same bits
        # as the general one, fewer operations); False: the general path (benchmarks).
        self.fast_decode = True
        embed = weights["embed"]
        assert embed is not None
        self.dtype = embed.dtype
        self.norm = _required(weights, "norm")
        self.quant_embed: QuantEmbedding | None = None
        self.head: Linear | QuantLinear
        self.lm_head: nn.Parameter | None
        quantized = isinstance(embed, QuantEmbedding)
        ready_head: Linear | None = None
        if quantized:
            # Weights kept quantized (quant/): the embedding looked up row by row, the head
            # and every projection computed by int4/int8 kernels; activations in its dtype.
            self.quant_embed = embed
            self.embed = nn.Parameter(torch.empty(0, dtype=embed.dtype, device=embed.device),
                                      requires_grad=False)  # (the device and dtype; no table)
            self.lm_head, self.head = None, weights["lm_head"]
            self.upcast_rows = 0
        else:
            self.embed = _param(embed)
            given = weights.get("lm_head")
            # A head packed in the node's weight arena comes ready-made (arena_layout.py).
            ready_head = given if isinstance(given, Linear) else None
            # Tied embeddings share the very same tensor, no copy.
            self.lm_head = None if ready_head is not None else (
                self.embed if given is None else _param(given))
            self.upcast_rows = default_upcast_rows(embed.dtype, embed.device)
        pack = own_weights and not quantized
        built = []
        for w in layers:
            layer = DecoderLayer(config, w, self.upcast_rows)
            if pack:
                layer.pack_linears()
            built.append(layer)
            del w  # the layer's plain (fused) copies that packing replaced go now
            if after_layer is not None:
                after_layer(layer)
        self.layers = nn.ModuleList(built)
        # The same modules, typed (nn.ModuleList yields plain Modules).
        self.decoder_layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        self.rope = RotaryTables(config, embed.dtype, embed.device)
        self.streamer: LayerSource | None = None  # remapped layers' source (None: all resident)
        if quantized:
            return
        if not own_weights:  # views into the shared arena: computed on as they are
            if ready_head is not None:
                self.head = ready_head
            else:
                assert self.lm_head is not None
                self.head = Linear(self.lm_head, None)
            for lin in self.linears():
                lin.choose_kernel(copy=False)
            return
        self._pack_head(weights.get("lm_head") is not None)

    def _pack_head(self, untied: bool) -> None:
        """A float head on its kernel, packed when float32 and untied (linear.py); the
        layers' linears were packed as they were built."""
        assert self.lm_head is not None
        head = Linear(self.lm_head, None)
        self.head = head
        if head.choose_kernel():
            if untied:  # (a tied head's copy is its own; the lookup reads embed)
                self.lm_head = _param(head.w)
        elif untied and head.pack():
            self.lm_head = None  # a tied head stays plain: the embedding lookup reads it

    def set_upcast_rows(self, rows: int) -> None:
        """Override the float32-compute threshold of half-precision linears (0 = never,
        which also frees their float32 weight copies)."""
        self.upcast_rows = rows
        for layer in self.decoder_layers:
            layer.upcast_rows = rows
        if not rows:
            for lin in self.linears():
                lin.release_float32()

    def linears(self) -> list[Linear]:
        """Every float linear of the model, the head first."""
        head = [self.head] if isinstance(self.head, Linear) else []
        return [*head, *(lin for layer in self.decoder_layers for lin in layer.linears())]

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight held: the parameters, plus what the linears hold outside
        them (oneDNN-packed float32 weights, float32 upcast copies, quantized codes and
        scales) and a quantized embedding's table."""
        params = {id(t): t for t in (*self.parameters(), *self.buffers())}
        total = sum(t.numel() * t.element_size() for t in params.values())
        lins = [self.head, *(lin for layer in self.decoder_layers
                             for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))]
        for lin in lins:
            if isinstance(lin, Linear):
                total += lin.unshared_bytes
            else:
                total += lin.weight_bytes
        if self.quant_embed is not None:
            total += self.quant_embed.weight_bytes
        return total

    @property
    def float32_copy_bytes(self) -> int:
        """Host bytes of float32 weight copies made so far for upcast linears."""
        return sum(lin.float32_bytes for lin in self.linears())

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        if self.quant_embed is not None:
            h = self.quant_embed.lookup(batch.input_ids)  # (T, hidden)
        else:
            h = F.embedding(batch.input_ids, self.embed)  # (T, hidden)
        cos, sin = self.rope.lookup(batch.positions)  # (T, 1, hd) each
        group = self.config.num_heads // self.config.num_kv_heads
        plan = build_plan(batch, kv_cache.shape[2], group, h.dtype)  # shared by every layer
        # Only the logits rows need the last layer's output (its K/V is needed for every
        # row): a prompt chunk computes that layer's attention, output projection and MLP
        # for its last token alone, ~7% of a 12-layer prefill. Decode steps have one row
        # per sequence anyway.
        out_rows = None
        if batch.logits_indices.numel() < batch.num_tokens:
            out_rows = OutputRows(batch.logits_indices, build_rows_plan(
                batch, batch.logits_indices.tolist(), plan.kv_rows, kv_cache.shape[2],
                h.dtype))
        decode = None
        if self.fast_decode and out_rows is None and DecodeStep.applies(plan):
            tables = batch.block_table_stack
            decode = DecodeStep(plan, torch.stack(batch.block_tables) if tables is None
                                else tables, kv_cache)
        last = len(self.layers) - 1
        streamer = self.streamer
        for i, layer in enumerate(self.decoder_layers):
            if streamer is not None:  # a remapped layer: computed in its slot (MIRAGE)
                layer = streamer.acquire(i)
            h = layer(h, i, batch, plan, kv_cache, cos, sin, out_rows if i == last else None,
                      decode)
            if streamer is not None:
                streamer.release(i)
        if out_rows is None:
            h = h[batch.logits_indices]  # only the rows whose logits are wanted
        h = rms_norm(h, self.norm, self.config.rms_norm_eps)
        return self.head(h, self.upcast_rows).float()
