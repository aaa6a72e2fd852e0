"""The attention of a step whose sequences all decode one token in one length group (every
batch-1 decode step, and batches of similar contexts), with what each layer indexes made
once per step instead of once per layer.

A decode step of a deep, thin model is bound by the number of tensor operations it issues,
not by its arithmetic: each costs a few microseconds of dispatch and allocation, and
SmolLM2's 30 layers issue ~45 each. The general path (``paged_attention.py``) re-derives
per layer what is the same for every layer of the step: the V rows (``k_rows + bs``),
the gather ids (``tables[:, :blocks]`` flattened), the K and V halves of the pool, the
flat pool view, and folds/unfolds the query heads through permutes and reshapes that are
plain views when there is one query token per sequence. Here those are made once for all
layers (``unbind`` of one tensor yields every layer's), leaving per layer the two K/V
writes, the two gathers and the one SDPA call.

The arithmetic is the general path's, on the same tensors with the same strides: the
same kernels see the same inputs, so logits and cache contents are bit-identical (tested
against ``paged_attention``), and reused KV still equals recomputed KV.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .paged_attention import AttentionPlan


class DecodeStep:
    """``attend(layer, q, k, v, scale)`` for every layer of one all-decode step."""

    __slots__ = ("flat", "ids", "k_pool", "k_rows", "kvh", "length", "mask", "shape",
                 "v_pool", "v_rows")

    def __init__(self, plan: AttentionPlan, tables: torch.Tensor,
                 kv_cache: torch.Tensor) -> None:
        """``tables``: (layers, seqs, max_blocks), the step's block tables stacked."""
        g = plan.decode_groups[0]
        nb, _, bs, kvh, hd = kv_cache.shape
        layers, seqs = tables.shape[0], tables.shape[1]
        self.flat = kv_cache.view(nb * 2 * bs, kvh, hd)
        self.k_pool, self.v_pool = kv_cache[:, 0], kv_cache[:, 1]
        self.k_rows = plan.kv_rows.unbind(0)
        self.v_rows = (plan.kv_rows + bs).unbind(0)
        self.ids = tables[:, :, :g.blocks].reshape(layers, seqs * g.blocks).unbind(0)
        self.shape = (seqs, g.blocks * bs, kvh, hd)
        self.kvh = kvh
        self.length = g.length
        self.mask = g.mask

    @staticmethod
    def applies(plan: AttentionPlan) -> bool:
        """Every row decodes, in one group covering every sequence in order."""
        return (plan.all_decode and len(plan.decode_groups) == 1
                and plan.decode_groups[0].rows is None)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Write layer ``layer``'s new k, v (S, kvh, hd) and attend q (S, heads, hd) over
        each sequence's context -> (S, heads * hd), as ``write_kv`` + ``paged_attention``."""
        self.flat.index_copy_(0, self.k_rows[layer], k)
        self.flat.index_copy_(0, self.v_rows[layer], v)
        ids = self.ids[layer]
        kg = self.k_pool.index_select(0, ids).view(self.shape).transpose(1, 2)
        vg = self.v_pool.index_select(0, ids).view(self.shape).transpose(1, 2)
        s, heads, hd = q.shape
        # One query token per sequence: folding the group's heads onto the query axis
        # (paged_attention._fold_groups) is this view, with the same strides.
        qf = q.view(s, self.kvh, heads // self.kvh, hd)
        if self.mask is None:  # one sequence: no padding to hide, slice instead
            n = self.length
            out = F.scaled_dot_product_attention(qf, kg[:, :, :n], vg[:, :, :n], scale=scale)
        else:
            out = F.scaled_dot_product_attention(qf, kg, vg, attn_mask=self.mask, scale=scale)
        return out.reshape(s, heads * hd)
