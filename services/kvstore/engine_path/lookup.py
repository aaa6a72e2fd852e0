"""LookupPrefix: the longest prefix of a prompt whose KV is stored in every layer
(``find_stored_prefix``).

Chunks are fixed on the block grid: chunk c covers blocks [c*C, min((c+1)*C, n)) of the
sequence that was saved (C = blocks_per_chunk) and is keyed by its LAST block hash::

    prompt:   | b0 .. b15 | b16 .. b31 | b32 .. b39 b40 .. b47 | b48 b49 |
    stored:   | chunk0    | chunk1     | chunk2 (saved at 40)  |
    keys:       h15         h31          h39 (a partial chunk of the last turn)
    match:    16          + 16         + 8  = 40, then stop (chunk2 is partial)

Per chunk the candidates are tried best first: the prompt's own full chunk (key h[s+C-1]),
then chunks of the session's known sequences (latest saved, or the manifest) whose blocks
agree with the prompt's for ``u`` leading blocks (usable for those ``u`` only), then a
chunk ending exactly at the prompt's last full block. Chained hashes make a match of
block i imply a match of every block before it. The search stops at the first chunk that
is missing in any layer, or that served fewer than C blocks.

Chunks that end at or before ``first_block`` are not probed (the engine holds those
blocks on device); ``matched_blocks`` still counts them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from dataclasses import dataclass, field

from services.kvstore.engine_path.leases import Lease
from services.kvstore.manifests import ManifestStore
from services.kvstore.manifests.manifest import scoped_session
from services.kvstore.store import TieredStore
from services.kvstore.tiers.base import Tier
from shared.chunk_codec import ChunkCorrupt, chunk_key, read_meta


@dataclass(frozen=True)
class Candidate:
    chunk_start: int
    chunk_hashes: tuple[bytes, ...]  # the stored chunk's block hashes, in order
    use_end: int  # the prompt's blocks [chunk_start, use_end) match this chunk


def chunk_candidates(
    prompt: tuple[bytes, ...], c: int, bpc: int, known: list[tuple[bytes, ...]]
) -> list[Candidate]:
    """Chunks that could serve the prompt's chunk ``c``, most blocks first (no I/O)."""
    s, n = c * bpc, len(prompt)
    e = min(s + bpc, n)
    out: list[Candidate] = []
    if e - s == bpc:
        out.append(Candidate(s, prompt[s:e], e))
    for seq in known:
        se = min(s + bpc, len(seq))
        u = 0
        while s + u < min(se, e) and seq[s + u] == prompt[s + u]:
            u += 1
        if u:
            out.append(Candidate(s, seq[s:se], s + u))
    if 0 < e - s < bpc:
        out.append(Candidate(s, prompt[s:e], e))
    seen: set[bytes] = set()
    best: list[Candidate] = []
    for cand in sorted(out, key=lambda x: -x.use_end):  # stable: full chunk stays first
        if cand.chunk_hashes[-1] not in seen:
            seen.add(cand.chunk_hashes[-1])
            best.append(cand)
    return best


@dataclass
class Probe:
    tier_index: int  # slowest tier over the layers (index into store.tiers)
    pins: list[tuple[Tier, str]] = field(default_factory=list)
    blobs: dict[str, object] = field(default_factory=dict)


async def probe_chunk(
    store: TieredStore, tenant: str, model_fp: str, cand: Candidate, num_layers: int,
    last_tier: int | None = None, durable: Collection[str] = (),
) -> Probe | None:
    """Whether ``cand`` is stored in every layer (in ``store.tiers[: last_tier + 1]``;
    None: any tier); pins/holds what it finds, or None.

    DRAM copies are checked against the expected block hashes here (their header is one
    msgpack read away); copies below DRAM are checked when loaded. Keys in ``durable``
    (named by a durable manifest: in the lowest tier) need no existence check there.
    """
    probe = Probe(0)
    below: list[str] = []
    for layer in range(num_layers):
        key = chunk_key(tenant, model_fp, cand.chunk_hashes[-1], layer)
        blob = store.dram_blob(key)
        if blob is not None:
            try:
                ok = read_meta(blob).block_hashes == cand.chunk_hashes
            except ChunkCorrupt:
                ok = False
            if ok:
                probe.blobs[key] = blob
                continue
        below.append(key)
    # Layers not in DRAM: the SSD index answers most without I/O; the rest are located
    # concurrently (S3 HEADs would add up otherwise).
    if below and last_tier == 0:
        return None
    lowest = store.lowest if last_tier is None else None
    tiers = [store.known_below_dram(k) or (lowest if k in durable else None) for k in below]
    ask = [i for i, t in enumerate(tiers) if t is None]
    if ask:
        for i, t in zip(ask, await asyncio.gather(
                *(store.first_tier_below_dram(below[i], last_tier) for i in ask)),
                strict=False):
            if t is None:
                return None
            tiers[i] = t
    # Pinned only now, with no await since the gather: a cancelled lookup leaks no pins.
    for t, k in zip(tiers, below, strict=False):
        assert t is not None
        store.pin(t, k)
        probe.pins.append((t, k))
        probe.tier_index = max(probe.tier_index, store.tiers.index(t))
    return probe


async def find_stored_prefix(
    store: TieredStore,
    tenant: str,
    model_fp: str,
    prompt: tuple[bytes, ...],
    first_block: int,
    num_layers: int,
    bpc: int,
    known: list[tuple[bytes, ...]],
    lease: Lease,
    last_tier: int | None = None,
    durable: Collection[str] = (),
) -> tuple[int, list[tuple[Candidate, int, int]]]:
    """(matched_blocks, [(candidate, span first block, slowest tier index)]), searching
    ``store.tiers[: last_tier + 1]`` (None: all).

    Fills ``lease`` with the held DRAM blobs, the SSD pins and the expected hashes.
    """
    matched = first_block - first_block % bpc  # whole chunks before first_block: on device
    found: list[tuple[Candidate, int, int]] = []
    c = first_block // bpc
    while c * bpc < len(prompt):
        hit: tuple[Candidate, Probe] | None = None
        for cand in chunk_candidates(prompt, c, bpc, known):
            probe = await probe_chunk(store, tenant, model_fp, cand, num_layers, last_tier,
                                      durable)
            if probe is not None:
                hit = (cand, probe)
                break
        if hit is None:
            break
        cand, probe = hit
        lease.blobs.update(probe.blobs)  # type: ignore[arg-type]
        lease.pins.extend(probe.pins)
        for layer in range(num_layers):
            key = chunk_key(tenant, model_fp, cand.chunk_hashes[-1], layer)
            lease.expected[key] = cand.chunk_hashes
        matched = cand.use_end
        found.append((cand, max(cand.chunk_start, first_block), probe.tier_index))
        if cand.use_end - cand.chunk_start < bpc:
            break
        c += 1
    return max(matched, first_block), found


@dataclass(frozen=True)
class Known:
    """What a lookup knows of a session: its saved sequences (to match partial chunks
    against) and the chunk keys its durable manifest names (in the lowest tier)."""

    seqs: list[tuple[bytes, ...]] = field(default_factory=list)
    durable: frozenset[str] = frozenset()


async def known_sequences(
    manifests: ManifestStore, tenant: str, session_id: str, model_fp: str, bpc: int,
    durable: bool = False, manifest: bool = True,
) -> Known:
    """The session's latest sequence saved here, else its manifest (with ``durable``, the
    manifest as well: another node may have saved a later turn; without ``manifest``,
    never the manifest)."""
    if not session_id:
        return Known()
    session_id = scoped_session(session_id, model_fp)
    out: list[tuple[bytes, ...]] = []
    latest = manifests.latest(tenant, session_id)
    if latest is not None and latest.model_fp == model_fp:
        out.append(latest.block_hashes)
        if not durable:
            return Known(out)
    if not manifest:
        return Known(out)
    m = await manifests.get_manifest(tenant, session_id)
    if m is None or m.model_fp != model_fp or m.blocks_per_chunk != bpc:
        return Known(out)
    if m.block_hashes not in out:
        out.append(m.block_hashes)
    return Known(out, frozenset(m.chunk_keys()))
