"""Attention over the paged KV pool (the layout of services/engine/forward_batch.py).

    kv_cache: (num_blocks, 2, block_size, kvh, hd)      one layer's K and V per block

A pool slot ``s = block * block_size + offset`` of K lives at flat row
``block * 2 * block_size + offset`` of ``kv_cache.view(-1, kvh, hd)`` and its V
``block_size`` rows further on. Reads gather a sequence's blocks with one index_select
per K and V into a contiguous (seqs, ctx, kvh, hd) tensor and run one
scaled_dot_product_attention for all decoding sequences, one per prefill chunk.

Grouped-query attention without copying K/V per query head: the ``group`` query heads that
share a KV head are folded into the query-length axis, so SDPA sees ``kvh`` heads:

    q (T, heads, hd) -> (kvh, group * T, hd)   rows ordered (group, token)

Single-token (decoding) sequences are attended together, padded to the longest context
of their group. A batch mixing long and short conversations would pay the longest context
for every sequence (a 2k-token one among seven of 300 tokens: 4x the keys gathered and
attended), so decodes are grouped by context length (``group_by_length``), one gather and
SDPA call per group.

Everything that is the same for every layer of a step (slot rows, masks, index tensors)
is built once per step in an AttentionPlan. Masks are additive (0 / -inf in the query
dtype): SDPA would convert a boolean mask to that form on every call, in every layer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..forward_batch import ForwardBatch


@dataclass
class PrefillChunk:
    seq: int  # index of the sequence in the batch
    start: int  # first row of its tokens in the packed batch
    length: int  # new tokens
    kv_len: int  # context after this step
    mask: torch.Tensor  # (group * length, kv_len) additive, rows ordered (group, token)


@dataclass
class DecodeGroup:
    """Single-token sequences attended in one SDPA call, padded to the longest context."""
    rows: torch.Tensor | None  # (D,) packed rows of their tokens; None = all rows, in order
    seqs: torch.Tensor | None  # (D,) their sequence indices; None = all sequences
    blocks: int  # blocks to gather (the longest context)
    length: int  # the longest context
    mask: torch.Tensor | None  # (D, 1, 1, blocks * block_size) additive; None when D == 1


@dataclass
class AttentionPlan:
    block_size: int
    kv_rows: torch.Tensor  # (layers, T) flat pool row of each new token's K
    decode_groups: list[DecodeGroup]
    all_decode: bool
    prefills: list[PrefillChunk] = field(default_factory=list)


# What one more decode group costs (an index_select and an SDPA call per layer), in keys
# attended: a call costs ~40-60 us, a key of a decode ~0.2 us (small model shapes, CPU).
GROUP_CALL_KEYS = 256


def group_by_length(lens: list[int], call_keys: int = GROUP_CALL_KEYS) -> list[list[int]]:
    """Split sequence indices into groups minimising the keys attended (each sequence pays
    its group's longest context) plus ``call_keys`` per group.

    An optimal split takes contiguous runs of the lengths sorted longest first. With
    ``L_j`` the distinct lengths (longest first) and ``S_j``/``E_j`` the sorted positions
    where length ``L_j`` starts/ends, the best cost of the first k lengths is

        best[k] = call_keys + min over j < k of (best[j] - L_j * S_j) + L_j * E_{k-1}

    a minimum of lines with falling slopes ``L_j`` queried at rising ``E_{k-1}``: a
    monotone convex-hull walk, O(n log n) for the sort and O(distinct) after it (a batch
    of 256 decodes with as many lengths costs well under a millisecond)."""
    if not lens:
        return []
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    distinct: list[int] = []  # lengths, longest first
    ends: list[int] = []  # number of sequences with a length >= distinct[k]
    for pos, i in enumerate(order, 1):
        if distinct and distinct[-1] == lens[i]:
            ends[-1] = pos
        else:
            distinct.append(lens[i])
            ends.append(pos)
    m = len(distinct)
    starts = [0, *ends[:-1]]
    best = [0] * (m + 1)
    cut = [0] * (m + 1)  # the last group of the first k lengths starts at length cut[k]
    hull: deque[tuple[int, int, int]] = deque()  # lines (slope, intercept, j)
    for k in range(1, m + 1):
        j = k - 1
        a, b = distinct[j], best[j] - distinct[j] * starts[j]
        while len(hull) >= 2:  # drop the last line if the new one overtakes it first
            a1, b1, _ = hull[-2]
            a2, b2, _ = hull[-1]
            if (b - b1) * (a1 - a2) <= (b2 - b1) * (a1 - a):
                hull.pop()
            else:
                break
        hull.append((a, b, j))
        x = ends[k - 1]
        while len(hull) >= 2 and hull[1][0] * x + hull[1][1] <= hull[0][0] * x + hull[0][1]:
            hull.popleft()
        a, b, j = hull[0]
        best[k], cut[k] = call_keys + a * x + b, j
    groups: list[list[int]] = []
    k = m
    while k:
        j = cut[k]
        groups.append(order[starts[j]:ends[k - 1]])
        k = j
    return groups[::-1]


def build_plan(batch: ForwardBatch, block_size: int, group: int,
               dtype: torch.dtype) -> AttentionPlan:
    """``dtype``: the queries' (the masks are added to scores of that dtype)."""
    device = batch.input_ids.device
    kv_rows = batch.kv_rows
    if kv_rows is None:
        slots = torch.stack(batch.slot_mapping)  # (layers, T)
        kv_rows = (slots // block_size) * (2 * block_size) + slots % block_size
    dec_rows: list[int] = []
    dec_seqs: list[int] = []
    prefills: list[PrefillChunk] = []
    start = 0
    for s, (n, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens, strict=True)):
        if n == 1:
            dec_rows.append(start)
            dec_seqs.append(s)
        elif n > 1:
            prefills.append(PrefillChunk(s, start, n, kv_len,
                                         _prefill_mask(n, kv_len, group, device, dtype)))
        start += n
    all_decode = not prefills
    # A lone group covers every row and sequence only if each sequence has its one row (a
    # sequence with no new tokens has none).
    whole = all_decode and len(dec_seqs) == batch.num_seqs
    groups = _decode_groups(dec_rows, dec_seqs, [batch.kv_lens[s] for s in dec_seqs],
                            whole, block_size, device, dtype)
    return AttentionPlan(block_size=block_size, kv_rows=kv_rows, decode_groups=groups,
                         all_decode=all_decode, prefills=prefills)


def build_rows_plan(batch: ForwardBatch, rows: list[int], kv_rows: torch.Tensor,
                    block_size: int, dtype: torch.dtype) -> AttentionPlan:
    """Attention for only the query rows ``rows`` of the step (the packed rows whose
    logits are wanted), each a one-token query over its own causal context: a row at
    position p of its sequence attends keys 0..p, as a decode at p would. The queries
    given to ``paged_attention`` are then ``q[rows]``. ``kv_rows``: the step's, for the
    writes (they cover every row).

    The last layer's output is read only at the logits rows, so only they need its
    attention, output projection and MLP; its K/V is still written for every row. For a
    prompt chunk of n tokens that skips n - 1 rows of the layer's most costly part."""
    device = batch.input_ids.device
    seq_of: list[int] = []
    ctx_of: list[int] = []
    for s, (n, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens, strict=True)):
        seq_of.extend([s] * n)
        ctx_of.extend(range(kv_len - n + 1, kv_len + 1))
    # Rows of decoding sequences are grouped as build_plan groups them. A row of a prompt
    # chunk gets a call of its own, as its chunk had: a prompt's first token then does not
    # depend on which other sequences share the step (a shared, padded call can change the
    # last bits).
    dec = [i for i, r in enumerate(rows) if batch.q_lens[seq_of[r]] == 1]
    seqs = [seq_of[r] for r in rows]
    whole = len(dec) == len(rows) and seqs == list(range(batch.num_seqs))
    groups = _decode_groups(dec, [seqs[i] for i in dec], [ctx_of[rows[i]] for i in dec],
                            whole, block_size, device, dtype)
    for i, r in enumerate(rows):
        if batch.q_lens[seq_of[r]] > 1:
            groups += _decode_groups([i], [seqs[i]], [ctx_of[r]], False, block_size, device,
                                     dtype)
    return AttentionPlan(block_size=block_size, kv_rows=kv_rows, decode_groups=groups,
                         all_decode=True)


def _decode_groups(rows: list[int], seqs: list[int], lens: list[int], may_be_whole: bool,
                   block_size: int, device: torch.device,
                   dtype: torch.dtype) -> list[DecodeGroup]:
    """One-token queries (query row ``rows[i]`` of sequence ``seqs[i]``, attending the
    first ``lens[i]`` keys) split into decode groups. ``may_be_whole``: the queries are
    every row of q and every sequence, in order, so a lone group needs no indexing."""
    members = group_by_length(lens, GROUP_CALL_KEYS)
    groups = []
    for idx in members:
        whole = may_be_whole and len(members) == 1
        idx = sorted(idx)  # batch order, as the rows of q and of the block tables
        glens = [lens[i] for i in idx]
        length = max(glens)
        blocks = -(-length // block_size)
        mask = None
        if len(idx) > 1:
            ctx = torch.arange(blocks * block_size, device=device)
            lt = torch.tensor(glens, device=device)
            mask = _additive(ctx[None, :] < lt[:, None], dtype)[:, None, None, :]
        groups.append(DecodeGroup(
            rows=None if whole else torch.tensor([rows[i] for i in idx], device=device),
            seqs=None if whole else torch.tensor([seqs[i] for i in idx], device=device),
            blocks=blocks, length=length, mask=mask))
    return groups


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``visible``, -inf elsewhere (every row has a visible key: no NaN rows)."""
    out = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return out.masked_fill_(~visible, float("-inf"))


def _prefill_mask(n: int, kv_len: int, group: int, device: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:
    """Query i of the chunk sits at position p + i (p = cached prefix) and sees keys 0..p+i:

        keys:    0 ........ p-1 | p ..... p+n-1
        query i: all visible    | causal, up to p+i
    """
    rows = torch.arange(n, device=device) + (kv_len - n)
    cols = torch.arange(kv_len, device=device)
    mask = _additive(cols[None, :] <= rows[:, None], dtype)  # (n, kv_len)
    return mask.repeat(group, 1) if group > 1 else mask


def write_kv(kv_cache: torch.Tensor, k_rows: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Store k, v (T, kvh, hd) at flat K rows (T,) from AttentionPlan.kv_rows."""
    nb, _, bs, kvh, hd = kv_cache.shape
    flat = kv_cache.view(nb * 2 * bs, kvh, hd)
    flat.index_copy_(0, k_rows, k)
    flat.index_copy_(0, k_rows + bs, v)


def gather_kv(kv_cache: torch.Tensor, tables: torch.Tensor,
              num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of the first ``num_blocks`` blocks of each row of ``tables`` (S, max_blocks):
    two (S, kvh, ctx, hd) views of contiguous (S, ctx, kvh, hd) gathers."""
    _, _, bs, kvh, hd = kv_cache.shape
    s = tables.shape[0]
    ids = tables[:, :num_blocks].reshape(-1)
    ctx = num_blocks * bs
    k = kv_cache[:, 0].index_select(0, ids).view(s, ctx, kvh, hd).transpose(1, 2)
    v = kv_cache[:, 1].index_select(0, ids).view(s, ctx, kvh, hd).transpose(1, 2)
    return k, v


def _fold_groups(q: torch.Tensor, kvh: int) -> torch.Tensor:
    """q (S, T, heads, hd) -> (S, kvh, group * T, hd)."""
    s, t, heads, hd = q.shape
    group = heads // kvh
    return q.view(s, t, kvh, group, hd).permute(0, 2, 3, 1, 4).reshape(s, kvh, group * t, hd)


def _unfold_groups(o: torch.Tensor, t: int) -> torch.Tensor:
    """o (S, kvh, group * T, hd) -> (S, T, heads * hd)."""
    s, kvh, gt, hd = o.shape
    group = gt // t
    return o.view(s, kvh, group, t, hd).permute(0, 3, 1, 2, 4).reshape(s, t, kvh * group * hd)


def _decode(g: DecodeGroup, q: torch.Tensor, kv_cache: torch.Tensor,
            tables: torch.Tensor, scale: float) -> torch.Tensor:
    """One new token per sequence of a group. q (D, heads, hd) -> (D, heads * hd)."""
    k, v = gather_kv(kv_cache, tables, g.blocks)
    qf = _fold_groups(q.unsqueeze(1), kv_cache.shape[3])  # (D, kvh, group, hd)
    if g.mask is None:
        # A single sequence has no padding to hide: slice instead of masking.
        n = g.length
        out = F.scaled_dot_product_attention(qf, k[:, :, :n], v[:, :, :n], scale=scale)
    else:
        out = F.scaled_dot_product_attention(qf, k, v, attn_mask=g.mask, scale=scale)
    return _unfold_groups(out, 1).squeeze(1)


def _prefill(chunk: PrefillChunk, q: torch.Tensor, kv_cache: torch.Tensor,
             table: torch.Tensor, scale: float) -> torch.Tensor:
    """Several new tokens of one sequence. q (n, heads, hd) -> (n, heads * hd)."""
    bs = kv_cache.shape[2]
    k, v = gather_kv(kv_cache, table.unsqueeze(0), -(-chunk.kv_len // bs))
    k, v = k[:, :, :chunk.kv_len], v[:, :, :chunk.kv_len]  # (1, kvh, kv_len, hd)
    qf = _fold_groups(q.unsqueeze(0), kv_cache.shape[3])  # (1, kvh, group * n, hd)
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=chunk.mask, scale=scale)
    return _unfold_groups(out, chunk.length).squeeze(0)


def paged_attention(plan: AttentionPlan, q: torch.Tensor, kv_cache: torch.Tensor,
                    tables: torch.Tensor, scale: float) -> torch.Tensor:
    """All sequences of a step. q (T, heads, hd) packed as in ForwardBatch -> (T, heads*hd);
    for a plan from ``build_rows_plan``, q holds only its rows."""
    if plan.all_decode and len(plan.decode_groups) == 1 and plan.decode_groups[0].rows is None:
        return _decode(plan.decode_groups[0], q, kv_cache, tables, scale)  # every row, in order
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    for c in plan.prefills:
        out[c.start:c.start + c.length] = _prefill(
            c, q[c.start:c.start + c.length], kv_cache, tables[c.seq], scale)
    for g in plan.decode_groups:
        assert g.rows is not None and g.seqs is not None
        out[g.rows] = _decode(g, q[g.rows], kv_cache, tables[g.seqs], scale)
    return out
