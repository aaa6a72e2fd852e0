"""The engine core's one boundary to KV kept off the device (DESIGN §3).

The core calls an ``Offload`` at a handful of named points of a step and of a request's
life; it never asks which kind it has:

    accept(plan)               a request arrives with a reuse plan (kept or dropped)
    add_prefetch(order)        an advised session to prefetch into free device blocks
    end_prefetch(session, ..)  its advisory ended unfollowed (invalidated or expired)
    begin_step()               before scheduling: reclaim blocks whose loads have ended
    forward(out)               around the forward pass: start this step's loads, yield the
                               per-layer wait, undo on failure
    after_forward(out, s)      before ``advance``: settle loads; returns the ids of the
                               requests whose load failed (the core requeues them)
    after_sample(seqs)         mid-generation saves of chunks that filled up
    finished(seq) / dropped(seq)   a request ended (save) / left before admission
    unpin(job, ok), attached(blocks_per_chunk)   the kvstore's answers (worker inbox)
    reclaimer, holds_blocks, held_blocks(), stats()

``NullOffload`` serves device-only and recompute runs: no loads, no saves, only the
accounting every run reports. ``KVStoreOffload`` (kvstore_offload.py) is the node's
kvstore. The core builds its offload with an ``OffloadFactory`` over its own block tables,
scheduler and pool. All of it runs on the engine's worker thread.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager

from services.engine.api_types import ReuseStats
from services.engine.kvcache.block_allocator import Reclaimer
from services.engine.kvcache.block_tables import BlockTables
from services.engine.kvcache.device_memory import DeviceMemory
from services.engine.offload.device_prefetch.orders import PrefetchOrder
from services.engine.reuse_plan import ReusePlan
from services.engine.scheduler import Scheduler, SchedulerOutput
from services.engine.sequence import Sequence
from shared.session_key import SessionKey

LayerWait = Callable[[int], None]  # the forward pass calls it before layer l reads the cache


class Offload:
    """The accounting every run reports; no stored KV. Subclasses add loads and saves."""

    def __init__(self) -> None:
        self.device_tokens = 0  # prompt tokens found in the device prefix cache
        self.recomputed_tokens = 0

    def accept(self, plan: ReusePlan | None) -> ReusePlan | None:
        """The plan a new request keeps (None: it recomputes what the device lacks)."""
        return None

    def begin_step(self) -> None:
        """Before scheduling."""

    def add_prefetch(self, order: PrefetchOrder) -> None:
        """An advised session to prefetch into free device blocks (none here)."""

    def end_prefetch(self, session: SessionKey, expired: bool) -> bool:
        """An advisory ended unfollowed (invalidated, or ``expired``); whether its session
        had prefetched blocks."""
        return False

    @contextmanager
    def forward(self, out: SchedulerOutput) -> Iterator[LayerWait | None]:
        """Around the step's forward pass: yields the per-layer wait (None: none)."""
        self._count_admissions(out)
        yield None

    def after_forward(self, out: SchedulerOutput, seconds: float) -> list[str]:
        """After the forward pass, before ``Scheduler.advance``: the ids of the requests
        whose output this step must be dropped and recomputed (a load failed)."""
        self._count_computed(out)
        return []

    def after_sample(self, seqs: list[Sequence]) -> None:
        """Sequences that got a token this step and go on."""

    def finished(self, seq: Sequence) -> None:
        """``seq`` ended (its blocks are freed right after)."""

    def dropped(self, seq: Sequence) -> None:
        """``seq`` left before admission (aborted, or it could never get blocks)."""
        seq.offload.plan = None

    def unpin(self, job_id: int, ok: bool) -> None:
        """A save was answered (``ok``: its chunks are stored)."""

    def attached(self, blocks_per_chunk: int) -> None:
        """The pool is attached to the kvstore, whose chunks are this many blocks."""

    @property
    def reclaimer(self) -> Reclaimer | None:
        """Who gives held device blocks back when the allocator runs dry (None: nobody)."""
        return None

    @property
    def holds_blocks(self) -> bool:
        """Whether blocks come back later without a step (pinned saves, parked loads)."""
        return False

    def held_blocks(self) -> list[int]:
        """Block references held here, one entry per reference (integrity checks)."""
        return []

    def fill_pending(self) -> bool:
        """Whether a step would start loading advised KV into free device memory now."""
        return False

    def stats(self) -> ReuseStats:
        return ReuseStats(device_tokens=self.device_tokens,
                          recomputed_tokens=self.recomputed_tokens)

    # ---- accounting ---------------------------------------------------------------------
    def _count_admissions(self, out: SchedulerOutput) -> None:
        """Device hits of requests admitted for the first time."""
        for seq, device_tokens in out.admitted:
            if not seq.offload.counted:
                seq.offload.counted = True
                self.device_tokens += min(device_tokens, seq.num_prompt_tokens)

    def _count_computed(self, out: SchedulerOutput, redone: Collection[str] = ()) -> None:
        """(before advance) prompt tokens this step computes (``redone``: requests whose
        step is dropped, to be recomputed)."""
        for s in out.sequences:
            if s.request_id in redone:
                continue
            start = s.num_computed_tokens
            end = start + out.num_scheduled_tokens[s.request_id]
            self.recomputed_tokens += max(0, min(end, s.num_prompt_tokens) - start)


class NullOffload(Offload):
    """Device-only and recompute runs: nothing is loaded or saved."""


# The core calls it once, in its constructor, over its own parts.
OffloadFactory = Callable[[BlockTables, Scheduler, DeviceMemory], Offload]
