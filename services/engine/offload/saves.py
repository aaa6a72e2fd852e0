"""Saves of a request's computed blocks to the node's kvstore (DESIGN §3, step 8). Worker
thread only.

    during generation   chunks that filled up since the last save ──► SaveJob
    request end         every full block not known saved ──► SaveJob
    either              the blocks are pinned (one more reference) until the kvstore
                        answers; ``unpin(job, ok)`` comes back through the worker inbox

    blocks: | saved ........ | new full chunks ....... | partial chunk | ...
            0          saved_blocks             end (multiple of blocks_per_chunk)
"""

from __future__ import annotations

import itertools

from services.engine.kvcache.block_tables import BlockTables
from services.engine.offload.jobs import SaveJob
from services.engine.offload.transport import KVTransport
from services.engine.sequence import Sequence
from shared.hashing import extend_block_hashes


class Saves:
    def __init__(self, kv: BlockTables, transport: KVTransport) -> None:
        self.kv = kv
        self.transport = transport
        self.pinned: dict[int, list[int]] = {}  # save job -> blocks held until answered
        self._saving: dict[int, tuple[Sequence, int]] = {}  # save job -> (seq, first block)
        # The kvstore's chunk size in blocks, once attached (an inbox command sets it);
        # 0 = not known: nothing is saved before a request ends.
        self.blocks_per_chunk = 0
        self._job_ids = itertools.count()

    def save(self, seq: Sequence) -> None:
        """(request end) Hand ``seq``'s full computed blocks not saved yet to the kvstore;
        they stay pinned (one more reference) until ``unpin`` with the job's id."""
        if seq.no_reuse or seq.device_only:
            return
        full = seq.num_computed_tokens // self.kv.block_size
        # From the first block not known saved: a mid-generation save still unanswered may
        # yet fail, and this is the sequence's last chance (its chunks already stored are
        # skipped by the kvstore without a copy).
        first = min([seq.offload.saved_blocks, *(f for s, f in self._saving.values() if s is seq)])
        if full > first:
            self._save_range(seq, first, full, seq.num_computed_tokens)

    def save_filled_chunks(self, seqs: list[Sequence]) -> None:
        """(during generation) Save the chunks that filled up since the last save."""
        bpc = self.blocks_per_chunk
        if bpc <= 0:
            return
        for seq in seqs:
            if seq.no_reuse or seq.device_only or seq.num_computed_tokens <= seq.num_prompt_tokens:
                continue  # still prefilling: its chunks go out from its first decode on
            end = seq.num_computed_tokens // self.kv.block_size // bpc * bpc
            if end - seq.offload.saved_blocks >= bpc:
                # (marked saved before the call: it may fail at once)
                first, seq.offload.saved_blocks = seq.offload.saved_blocks, end
                self._save_range(seq, first, end, end * self.kv.block_size)

    def _save_range(self, seq: Sequence, first: int, end: int, tokens: int) -> None:
        """Save blocks [first, end) (``first`` a chunk boundary) with the hashes [0, end),
        as a sequence of ``tokens`` tokens."""
        bs = self.kv.block_size
        extend_block_hashes(seq.block_hashes, seq.token_ids, bs, seq.hash_seed)
        ids = self.kv.table_slice(seq, first, end)
        self.kv.blocks.touch(ids)
        job = SaveJob(next(self._job_ids), seq.session, tuple(seq.block_hashes[:end]),
                      tokens, first, tuple(ids))
        self.pinned[job.job_id] = ids
        self._saving[job.job_id] = (seq, first)
        self.transport.start_save(job)

    def unpin(self, job_id: int, ok: bool = True) -> None:
        """Save ``job_id`` was answered; not ``ok``: its chunks were not stored, so the
        sequence's next save starts where this one did (a gap would leave every later
        chunk of the session stored but unreachable: lookups stop at the first missing)."""
        ids = self.pinned.pop(job_id, None)
        saving = self._saving.pop(job_id, None)
        if not ok and saving is not None:
            seq, first = saving
            seq.offload.saved_blocks = min(seq.offload.saved_blocks, first)
        if ids:
            self.kv.blocks.free(reversed(ids))  # later layers first: evicted first

    def held_blocks(self) -> list[int]:
        """Block references pinned by saves in flight, one entry per reference."""
        return [b for ids in self.pinned.values() for b in ids]
