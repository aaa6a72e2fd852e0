"""Continuous batching with chunked prefill under a per-step token budget.

One step, three small passes over plain data:

    1. running sequences that decode (1 token each)        oldest first
    2. running sequences still prefilling (a chunk each)   oldest first
    3. waiting sequences admitted in queue order (device prefix hit + planned kvstore
       load + first chunk) while budget, seats and blocks last; the head of the queue is
       never skipped. The queue is ordered by request priority (higher first), FCFS
       within a priority (Symphony §3.6: high-priority sessions are admitted first)

When a running sequence cannot get blocks, the youngest running sequence is preempted by
recompute (its blocks freed, requeued at the FRONT of the waiting queue, to be recomputed,
often from its own now-cached blocks). The result is data: ``{request_id: num_tokens}``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.session_key import SessionKey

from .kvcache.block_tables import BlockTables
from .reuse_plan import ReusePlan
from .sequence import Sequence, Status
from .wait_forecast import QueueShape, StepCost

log = logging.getLogger(__name__)

MAX_OVERTAKES = 32  # higher-priority arrivals that may be queued ahead of a waiting one


@dataclass
class SchedulerOutput:
    """What to compute this step, in batch order."""

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    sequences: list[Sequence] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Sequences admitted this step, with the prompt tokens found on device.
    admitted: list[tuple[Sequence, int]] = field(default_factory=list)
    # Of those, the ones whose stored prefix is loaded during this step (offload).
    loads: list[tuple[Sequence, ReusePlan]] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def empty(self) -> bool:
        return not self.num_scheduled_tokens


class Scheduler:
    def __init__(self, kv: BlockTables, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by arrival
        self.num_preemptions = 0
        self.num_admitted = 0  # sequences that left the waiting queue for a seat, ever

    # ---- queue ops ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` behind every waiting sequence of its priority or higher. It never
        passes one put back at the front (preempted, or its load failed), nor one already
        passed ``MAX_OVERTAKES`` times: a stream of higher priorities delays a request,
        never starves it."""
        seq.status = Status.WAITING
        seq.waiting_since = time.monotonic()
        if not self.waiting or self.waiting[-1].priority >= seq.priority:
            self.waiting.append(seq)  # the common case: no higher priority than the last
            return
        at = len(self.waiting)
        for i in range(len(self.waiting) - 1, -1, -1):
            other = self.waiting[i]
            if other.overtaken >= MAX_OVERTAKES or other.priority >= seq.priority:
                break
            at = i
        for other in list(self.waiting)[at:]:
            other.overtaken += 1
        self.waiting.insert(at, seq)

    def oldest_waiting_since(self) -> float:
        """When the longest-waiting queued sequence entered the queue (0.0: none waits)."""
        return min((s.waiting_since for s in self.waiting), default=0.0)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def queue_shape(self, cost: StepCost) -> QueueShape:
        """The queue as admission's forecast sees it (``wait_forecast.py``): prompt tokens
        still to compute (less what a planned load brings), the running sequences'
        expected output left, and the measured step costs."""
        bs = self.kv.block_size
        prefill = 0
        for q in self.waiting:
            plan = q.offload.plan
            loaded = plan.end_block * bs if plan is not None else 0
            prefill += max(1, q.num_tokens - q.num_computed_tokens - loaded)
        prefill += sum(r for q in self.running if (r := q.num_tokens - q.num_computed_tokens) > 1)
        left = sorted(cost.expected_left(q.num_output_tokens, q.max_total_tokens - q.num_tokens)
                      for q in self.running)
        return QueueShape(len(self.waiting), prefill, len(self.running), self.max_num_seqs,
                          self.max_num_batched_tokens, tuple(left), cost.decode_step_s,
                          cost.prefill_s_per_token)

    def sessions(self) -> set[SessionKey]:
        """The sessions with a request here (running or waiting)."""
        return {q.session for q in (*self.running, *self.waiting) if q.session_id}

    def blocks_wanted_next_step(self) -> int:
        """Free blocks the next step may take: what the running sequences need (the rest
        of their prompt, a block per layer to grow) and the whole prompt of the head of the
        queue. The device prefetch leaves these to requests."""
        layers, kv = self.kv.num_layers, self.kv
        n = sum(kv.blocks_needed(q, q.num_tokens - q.num_computed_tokens) + layers
                for q in self.running)
        if self.waiting:
            head = self.waiting[0]
            n += layers * -(-head.num_tokens // kv.block_size)
        return n

    def pending_kv_blocks(self) -> int:
        """Blocks the queue needs beyond what its sequences hold: the rest of each running
        sequence's tokens (a decode's next block) and the head of the queue's whole prompt
        (MIRAGE's trigger: more than the allocator can hand out is KV running out)."""
        kv = self.kv
        n = sum(kv.blocks_needed(q, q.num_tokens - q.num_computed_tokens) for q in self.running)
        if self.waiting:
            n += kv.num_layers * -(-self.waiting[0].num_tokens // kv.block_size)
        return n

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and release its blocks."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq.status == Status.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = Status.FINISHED

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._schedule_running(out, lambda remaining: remaining == 1)  # decodes
        self._schedule_running(out, lambda remaining: remaining > 1)  # prefill chunks
        self._admit_waiting(out)
        return out

    def _budget(self, out: SchedulerOutput) -> int:
        return self.max_num_batched_tokens - out.total_tokens

    def _schedule_running(self, out: SchedulerOutput, wanted: Callable[[int], bool]) -> None:
        """Schedule running sequences whose count of tokens left to compute is ``wanted``."""
        for seq in list(self.running):
            if seq.status != Status.RUNNING:
                continue  # preempted earlier in this pass
            remaining = seq.num_tokens - seq.num_computed_tokens
            if not wanted(remaining):
                continue
            n = min(remaining, self._budget(out))
            if n <= 0:
                return
            if self._allocate_or_preempt(seq, n, out):
                out.num_scheduled_tokens[seq.request_id] = n
                out.sequences.append(seq)

    def _allocate_or_preempt(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Allocate blocks for ``n`` more tokens of ``seq``, preempting younger running
        sequences (then ``seq`` itself) until it fits. False if ``seq`` was preempted."""
        while not self.kv.allocate(seq, n):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.requeue(seq, out)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq.request_id)
        log.debug("preempted %s (recompute, %d tokens)", seq.request_id, seq.num_tokens)

    def requeue(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Take a running ``seq`` out of this step, free its blocks and put it at the front
        of the queue, to be recomputed (from whatever the device cache still holds)."""
        if seq.request_id in out.num_scheduled_tokens:  # scheduled earlier this step: undo
            del out.num_scheduled_tokens[seq.request_id]
            out.sequences.remove(seq)
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = Status.WAITING
        seq.waiting_since = time.monotonic()
        seq.overtaken = MAX_OVERTAKES  # back at the front, where it stays
        self.waiting.appendleft(seq)

    def _admit_waiting(self, out: SchedulerOutput) -> None:
        admitted = False
        while self.waiting and len(self.running) < self.max_num_seqs:
            budget = self._budget(out)
            if budget <= 0:
                break
            seq = self.waiting[0]
            if seq.request_id in out.preempted:
                break  # preempted this step: its blocks are what the others needed
            cached = [] if seq.no_reuse else self.kv.find_cached_prefix(seq)
            device_tokens = len(cached) * self.kv.block_size
            plan = seq.offload.load_after(len(cached))
            partial: list[list[int]] = []
            if plan is not None:
                # Blocks whose lower layers are on device: only the upper ones are loaded.
                partial, k = self.kv.find_partial_run(seq, len(cached))
                partial = partial[: plan.end_block - len(cached)]
                plan = plan.with_resident(len(partial), k)
            load_tokens = (plan.end_block - len(cached)) * self.kv.block_size if plan else 0
            hit_tokens = device_tokens + load_tokens
            n = min(seq.num_tokens - hit_tokens, budget)
            if not self.kv.allocate(seq, load_tokens + n, cached, partial):
                break  # FCFS: wait for blocks rather than let a later request overtake
            seq.offload.partial_blocks = len(partial)
            if plan is not None:
                # The loaded range counts as computed; the first step waits for it per layer.
                seq.num_computed_tokens += load_tokens
                out.loads.append((seq, plan))
            out.admitted.append((seq, device_tokens))
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = min(hit_tokens, seq.num_prompt_tokens)
            self.waiting.popleft()
            self.num_admitted += 1
            seq.status = Status.RUNNING
            self.running.append(seq)
            admitted = True
            out.num_scheduled_tokens[seq.request_id] = n
            out.sequences.append(seq)
        if admitted:
            self.running.sort(key=lambda s: s.arrival)

    # ---- after the step -----------------------------------------------------------------
    def advance(self, out: SchedulerOutput) -> list[Sequence]:
        """Count the step's tokens as computed; the sequences now due a sampled token."""
        due = []
        for seq in out.sequences:
            seq.num_computed_tokens += out.num_scheduled_tokens[seq.request_id]
            self.kv.register_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                due.append(seq)
        return due
