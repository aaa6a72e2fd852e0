"""The engine core's one boundary to KV kept off the device (DESIGN §3).

The core calls an ``Offload`` at a handful of named points of a step and of a request's
life; it never asks which kind it has:

    accept(plan)               a request arrives with a lookup's plan (kept or dropped)
    add_prefetch(order)        an advised session to prefetch into free device blocks
    end_prefetch(...)          its advisory ended unfollowed (invalidated or expired)
    begin_step()               before scheduling: reclaim blocks whose loads have ended
    forward(out)               around the forward pass: start this step's loads, yield the
                               per-layer wait, undo on failure
    after_forward(out, s)      before ``advance``: settle loads (a failed one is requeued)
    after_sample(seqs)         mid-generation saves of chunks that filled up
    finished(seq) / dropped(seq)   a request ended (save) / left before admission
    unpin(job, ok), holds_blocks, held_blocks(), stats()

``NullOffload`` serves device-only and recompute runs: no loads, no saves, only the
accounting every run reports. ``KVStoreOffload`` (kvstore_offload.py) is the node's
kvstore. All of it runs on the engine's worker thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from services.engine.api_types import ReuseStats
from services.engine.offload.device_prefetch import PrefetchOrder
from services.engine.offload.planner import ReusePlan
from services.engine.scheduler import SchedulerOutput
from services.engine.sequence import Sequence

LayerWait = Callable[[int], None]


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

    def end_prefetch(self, tenant: str, session_id: str, expired: bool) -> bool:
        """An advisory ended unfollowed (invalidated, or ``expired``); whether its session
        had prefetched blocks."""
        return False

    @contextmanager
    def forward(self, out: SchedulerOutput) -> Iterator[LayerWait | None]:
        """Around the step's forward pass: yields the per-layer wait (None: none)."""
        self._count_admissions(out)
        yield None

    def after_forward(self, out: SchedulerOutput, seconds: float) -> None:
        """After the forward pass, before ``Scheduler.advance``."""
        self._count_computed(out)

    def after_sample(self, seqs: list[Sequence]) -> None:
        """Sequences that got a token this step and go on."""

    def finished(self, seq: Sequence) -> None:
        """``seq`` ended (its blocks are freed right after)."""

    def dropped(self, seq: Sequence) -> None:
        """``seq`` left before admission (aborted, or it could never get blocks)."""
        seq.offload.plan = None

    def unpin(self, job_id: int, ok: bool) -> None:
        """A save was answered (``ok``: its chunks are stored)."""

    @property
    def holds_blocks(self) -> bool:
        """Whether blocks come back later without a step (pinned saves, parked loads)."""
        return False

    def held_blocks(self) -> list[int]:
        """Block references held here, one entry per reference (integrity checks)."""
        return []

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

    def _count_computed(self, out: SchedulerOutput) -> None:
        """(before advance) prompt tokens this step computes."""
        for s in out.sequences:
            start = s.num_computed_tokens
            end = start + out.num_scheduled_tokens[s.request_id]
            self.recomputed_tokens += max(0, min(end, s.num_prompt_tokens) - start)


class NullOffload(Offload):
    """Device-only and recompute runs: nothing is loaded or saved."""
