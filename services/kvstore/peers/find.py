"""FindPrefix, both ends: ask the peer that served a session's last turn what it holds of
a prompt, and answer such a question.

The answering node first waits (bounded by ``kvstore.peer_wait_s``) until its save of
that turn has landed: the asking node got the turn's length from the scheduler, so it is
served the whole history or, past the bound, what is there, never a prefix cut at a save
that was about to land. It then runs the same prefix search as a local lookup, leases
what it found (held DRAM copies, pinned SSD files) and names every chunk with all its
block hashes, which the asker checks against its prompt before trusting any of it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from services.kvstore import wire
from services.kvstore.engine_path.attach import PoolError
from services.kvstore.engine_path.leases import Lease, LeaseTable
from services.kvstore.engine_path.lookup import find_stored_prefix, known_sequences
from services.kvstore.engine_path.types import FindRequest, FoundOnPeer, PeerChunk
from services.kvstore.manifests import ManifestStore
from services.kvstore.manifests.manifest import scoped_session
from services.kvstore.peers.links import PeerLinks
from services.kvstore.store import TieredStore
from shared.session_key import SessionKey

log = logging.getLogger(__name__)

MAX_BLOCKS_PER_CHUNK = 4096


@dataclass(frozen=True)
class PeerAnswer:
    """What a peer holds beyond ``first_block``, checked against the prompt."""

    matched_blocks: int
    chunks: tuple[PeerChunk, ...]
    lease_id: str
    data_port: int = 0


async def ask_peer(
    links: PeerLinks, peer: str, req: FindRequest, timeout_s: float
) -> PeerAnswer | None:
    """The peer's answer (its chunks contiguous from ``req.first_block`` and matching the
    prompt), or None when it is unreachable, slow or answers nonsense: the caller then
    looks elsewhere (S3) or recomputes."""
    try:
        reply = await links.stub(peer).FindPrefix(wire.find_request(req), timeout=timeout_s)
    except grpc.aio.AioRpcError as e:
        log.warning("FindPrefix at peer %s failed (the prompt recomputes or comes from S3): "
                    "%s %s", peer, e.code().name, e.details())
        return None
    found = wire.found_from_pb(reply)
    chunks = _matching(found.chunks, req)
    if len(chunks) < len(found.chunks):
        log.warning("peer %s named %d chunks that do not match the prompt; using the %d "
                    "before them", peer, len(found.chunks) - len(chunks), len(chunks))
    if not chunks:
        if found.lease_id:
            await release_quietly(links, peer, found.lease_id, timeout_s)
        return PeerAnswer(req.first_block, (), "")
    end = chunks[-1].first_block + chunks[-1].use_blocks
    return PeerAnswer(end, chunks, found.lease_id, found.data_port)


def _matching(chunks: tuple[PeerChunk, ...], req: FindRequest) -> tuple[PeerChunk, ...]:
    """The leading chunks that continue each other from ``req.first_block``, sit on the
    chunk grid and carry the prompt's own block hashes for the blocks they serve."""
    out: list[PeerChunk] = []
    at, bpc, prompt = req.first_block, req.blocks_per_chunk, req.block_hashes
    for c in chunks:
        off = c.first_block % bpc
        ok = (
            c.first_block == at and c.use_blocks > 0 and 0 < len(c.chunk_hashes) <= bpc
            and off + c.use_blocks <= len(c.chunk_hashes)
            and c.first_block + c.use_blocks <= len(prompt)
            and c.chunk_hashes[off : off + c.use_blocks]
            == prompt[c.first_block : c.first_block + c.use_blocks]
        )
        if not ok:
            break
        out.append(c)
        at += c.use_blocks
    return tuple(out)


async def release_quietly(links: PeerLinks, peer: str, lease_id: str, timeout_s: float) -> None:
    try:
        await links.stub(peer).ReleaseLease(wire.release_request(lease_id), timeout=timeout_s)
    except grpc.aio.AioRpcError:
        pass  # the lease expires on its own


async def answer_peer(
    store: TieredStore,
    manifests: ManifestStore,
    leases: LeaseTable,
    req: FindRequest,
    wait_s: float,
    data_port: int = 0,
) -> FoundOnPeer:
    """What this node holds of ``req``'s prompt, leased. Raises ``PoolError`` or
    ``ChunkFormatError`` for a malformed request."""
    bpc = req.blocks_per_chunk
    if not 0 < bpc <= MAX_BLOCKS_PER_CHUNK:
        raise PoolError(f"blocks_per_chunk must be in 1..{MAX_BLOCKS_PER_CHUNK}, got {bpc}")
    if req.num_layers <= 0:
        raise PoolError("num_layers must be positive")
    if req.first_block > len(req.block_hashes):
        raise PoolError(
            f"first_block {req.first_block} is past the {len(req.block_hashes)} block hashes")
    waited = 0.0
    sid = SessionKey(req.tenant, scoped_session(req.session_id, req.model_fp))
    if req.session_id and req.wait_tokens:
        waited = await manifests.saves.wait(sid, req.wait_tokens, wait_s)
        store.metrics.peer_wait_seconds.observe(waited)
        if not manifests.saves.settled(sid, req.wait_tokens):
            log.info("a peer asked for %d tokens of a session; %.2f s later this node's "
                     "save has not landed: answering with what is here", req.wait_tokens,
                     waited)
    known = await known_sequences(manifests, req.tenant, req.session_id, req.model_fp, bpc)
    lease = Lease("")
    try:
        # Only this node's own tiers: a shared S3 tier the asker reads itself, directly.
        matched, found = await find_stored_prefix(
            store, req.tenant, req.model_fp, req.block_hashes, req.first_block,
            req.num_layers, bpc, known.seqs, lease,
            len(store.tiers) - 2 if store.lowest_shared else None,
        )
    except BaseException:
        LeaseTable.abandon(lease, store.unpin)
        raise
    chunks = tuple(
        PeerChunk(cand.chunk_hashes, start, cand.use_end - start, store.tiers[tier].name)
        for cand, start, tier in found if cand.use_end > start
    )
    store.metrics.peer_served.labels("hit" if chunks else "miss").inc()
    if not chunks:
        LeaseTable.abandon(lease, store.unpin)
        return FoundOnPeer(matched, (), "", waited)
    return FoundOnPeer(matched, chunks, leases.grant(lease), waited, data_port)
