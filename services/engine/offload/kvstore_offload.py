"""The node's kvstore behind the core's offload boundary (DESIGN §3, steps 5, 6, 8).

The worker-thread side: never blocks on the network. RPCs run on the event loop behind a
``KVTransport`` whose methods only post work there.

    admission (scheduler)  blocks [device, end) allocated in every layer, counted computed
    forward: start loads   LoadJob per loading sequence ──► transport (event loop)
    forward pass           wait_for_layer(l): layer l of every loading sequence resident
    after_forward: settle  all layers ok: index as usual | a layer failed: drop the step's
                           output for it, free (never index) the loaded blocks, requeue it
    finished (save)        pin full blocks, SaveJob ──► transport; unpin(job) when answered

Blocks a failed load may still be writing into (its RPC has not ended) are *parked*: held
by an extra reference until the readiness says the RPC finished, so no other sequence can
be given them meanwhile.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from services.engine.api_types import ReuseStats
from services.engine.config import EngineConfig
from services.engine.kvcache.block_tables import BlockTables
from services.engine.offload.base import LayerWait, Offload
from services.engine.offload.device_prefetch import DevicePrefetch, PrefetchOrder
from services.engine.offload.jobs import LoadJob, SaveJob
from services.engine.offload.layer_readiness import LayerReadiness
from services.engine.offload.planner import SKIP, WHOLE_PREFIX, PrefillRate, ReusePlan
from services.engine.scheduler import Scheduler, SchedulerOutput
from services.engine.sequence import Sequence
from shared.hashing import extend_block_hashes
from shared.session_key import SessionKey

log = logging.getLogger(__name__)


class KVTransport(Protocol):
    """Thread-safe: each call only hands the job to the event loop."""

    def start_load(self, job: LoadJob) -> None: ...

    def start_save(self, job: SaveJob) -> None: ...

    def release(self, lease_id: str) -> None: ...


class KVStoreOffload(Offload):
    def __init__(
        self,
        kv: BlockTables,
        scheduler: Scheduler,
        *,
        whole_prefix: bool,
        load_timeout_s: float,
        prefill_prior_s_per_token: float,
        pool_on_cpu: bool = True,
        block_bytes: int = 0,
        cooperative: bool = True,
        purge_order: str = "layers",
    ) -> None:
        super().__init__()
        self.kv = kv
        self.scheduler = scheduler
        self.whole_prefix = whole_prefix
        self.pool_on_cpu = pool_on_cpu  # the kvstore's copies compete with the forward pass
        self.load_timeout_s = load_timeout_s
        self.transport: KVTransport | None = None  # set by the AsyncEngine when connected
        self.prefill_rate = PrefillRate(prefill_prior_s_per_token)
        self.pinned: dict[int, list[int]] = {}  # save job -> blocks held until answered
        self._saving: dict[int, tuple[Sequence, int]] = {}  # save job -> (seq, first block)
        self.parked: list[tuple[LayerReadiness, list[int]]] = []
        self.loaded_tokens: dict[str, int] = {}
        self.load_failures = 0
        self.last_load_s = 0.0  # admission to last layer resident, of the latest load
        # kvstore chunk size in blocks, once attached (written by the event loop); 0 = not
        # known: nothing is saved before a request ends.
        self.blocks_per_chunk = 0
        self._job_ids = itertools.count()
        self._restore_threads = 0  # intra-op threads to restore after an overlapped step
        self._loading: list[Sequence] = []  # this step's loads, from forward to settle
        self.prefetch = DevicePrefetch(kv, block_bytes, cooperative=cooperative,
                                       purge_order=purge_order)
        self.prefetch.start_load = self._start_prefetch_load
        self.prefetch.release_lease = self._release_lease
        self.prefetch.reserve = self._reserve
        self.prefetch.live_sessions = self._live_sessions

    # ---- the boundary -------------------------------------------------------------------
    def accept(self, plan: ReusePlan | None) -> ReusePlan | None:
        return plan

    def begin_step(self) -> None:
        self.unpark()
        if self.transport is not None:
            self.prefetch.begin_step()

    def add_prefetch(self, order: PrefetchOrder) -> None:
        self.prefetch.add(order)
        if self.transport is not None:
            self.prefetch.fill()  # now: a request right behind it finds the load in flight

    def end_prefetch(self, tenant: str, session_id: str, expired: bool) -> bool:
        return self.prefetch.end(tenant, session_id, expired)

    def _start_prefetch_load(self, job: LoadJob) -> None:
        if self.transport is None:
            job.readiness.fail(0, "no kvstore transport")
            job.readiness.finish()
            return
        self.transport.start_load(job)

    def _reserve(self) -> int:
        """Free blocks prefetch leaves to requests: what the running ones may take in the
        next step (their prompt's rest, a block per layer to grow) and the whole prompt of
        the request at the head of the queue."""
        layers, s = self.kv.num_layers, self.scheduler
        n = sum(self.kv.blocks_needed(q, q.num_tokens - q.num_computed_tokens) + layers
                for q in s.running)
        if s.waiting:
            head = s.waiting[0]
            n += layers * -(-head.num_tokens // self.kv.block_size)
        return n

    def _live_sessions(self) -> set[SessionKey]:
        s = self.scheduler
        return {SessionKey(q.tenant, q.session_id)
                for q in (*s.running, *s.waiting) if q.session_id}

    def _release_lease(self, lease_id: str) -> None:
        if lease_id and self.transport is not None:
            self.transport.release(lease_id)

    @contextmanager
    def forward(self, out: SchedulerOutput) -> Iterator[LayerWait | None]:
        self._count_admissions(out)
        for seq, _ in out.admitted:
            self.prefetch.admitted(seq)
        self._release_unused(out)
        loading = self._loading = self.start_loads(out)
        try:
            yield self.waiter(loading)
        except BaseException:
            self._loading = []
            self.abandon(loading)  # before the failure frees the requests' blocks
            raise
        finally:
            self.end_forward()

    def after_forward(self, out: SchedulerOutput, seconds: float) -> None:
        loading, self._loading = self._loading, []
        if not loading:  # waits for loads would distort the measured compute rate
            self.prefill_rate.observe(out.total_tokens, seconds)
        self.settle(loading, out)
        self._count_computed(out)

    def after_sample(self, seqs: list[Sequence]) -> None:
        self.save_filled_chunks(seqs)

    def finished(self, seq: Sequence) -> None:
        self.save(seq)  # pins its full blocks until the kvstore has them

    def dropped(self, seq: Sequence) -> None:
        self.drop_plan(seq)

    @property
    def holds_blocks(self) -> bool:
        return bool(self.pinned or self.parked) or self.prefetch.loading

    def _release_unused(self, out: SchedulerOutput) -> None:
        """Admitted requests whose plan is not loaded (the device had it all, or a gap
        opened) give their lease back; every admitted plan is consumed."""
        loading = {id(seq) for seq, _ in out.loads}
        for seq, _ in out.admitted:
            plan, seq.offload.plan = seq.offload.plan, None
            if plan is None or not plan.lease_id or id(seq) in loading:
                continue
            if self.transport is not None:
                self.transport.release(plan.lease_id)

    # ---- loads --------------------------------------------------------------------------
    def start_loads(self, out: SchedulerOutput) -> list[Sequence]:
        """Hand this step's loads to the transport; the sequences now loading."""
        loading = []
        layers = self.kv.num_layers
        for seq, plan in out.loads:
            ready = LayerReadiness(layers)
            seq.offload.readiness, seq.offload.load = ready, plan
            loading.append(seq)
            if self.transport is None:
                ready.fail(0, "no kvstore transport")
                ready.finish()
                continue
            ids = plan.target_ids(self.kv.table_slice(seq, plan.first_block, plan.end_block),
                                  layers)
            self.transport.start_load(LoadJob(seq.request_id, seq.tenant, plan, tuple(ids), ready))
        return loading

    def waiter(self, loading: list[Sequence]) -> LayerWait | None:
        """The forward pass's per-layer wait over the loading sequences (None: nothing to
        wait for). whole_prefix waits for every layer before the first one runs.

        On a CPU pool the kvstore's copies run on the same cores as the forward pass. A
        layer computed while copies are still going uses one intra-op thread fewer: an
        OpenMP team with as many threads as cores, one of them preempted by the copy,
        waits at every barrier for it (measured: a 2k-token DRAM load overlapped with the
        full team cost ~2x the load's own time; whole-prefix loading beat it)."""
        readies = [r for s in loading if (r := s.offload.readiness) is not None]
        if not readies:
            return None
        last, timeout = self.kv.num_layers - 1, self.load_timeout_s
        full = torch.get_num_threads()
        share_cores = self.pool_on_cpu and not self.whole_prefix and full > 1

        def budget() -> None:
            copying = any(not (r.complete or r.failed) for r in readies)
            want = full - 1 if copying else full
            if torch.get_num_threads() != want:
                torch.set_num_threads(want)
                self._restore_threads = full

        if share_cores:
            budget()  # from the step's first op on: the copies have just started

        def wait_for_layer(layer: int) -> None:
            target = last if self.whole_prefix else layer
            for r in readies:
                r.wait(target, timeout)  # a failure is settled after the step
            if share_cores:
                budget()

        return wait_for_layer

    def end_forward(self) -> None:
        """(after every forward pass, also a failed one) Give back a core taken by the
        waiter's thread budget."""
        if self._restore_threads:
            torch.set_num_threads(self._restore_threads)
            self._restore_threads = 0

    def settle(self, loading: list[Sequence], out: SchedulerOutput) -> None:
        """After the step: count complete loads; send failed ones back to be recomputed
        (taken out of ``out`` so their output is neither indexed nor sampled)."""
        bs = self.kv.block_size
        for seq in loading:
            ready, plan = seq.offload.readiness, seq.offload.load
            seq.offload.readiness = seq.offload.load = None
            assert ready is not None and plan is not None
            if ready.complete:
                self.last_load_s = ready.completed_at - ready.created
                seq.offload.loaded_from = loaded_from(plan)
                for s in plan.spans:
                    tokens = self.loaded_tokens.get(s.tier, 0) + s.use_blocks * bs
                    self.loaded_tokens[s.tier] = tokens
                continue
            self.load_failures += 1
            log.warning("KV load of %s failed (%s); recomputing blocks %d..%d",
                        seq.request_id, ready.error, plan.first_block, plan.end_block)
            self._park_unfinished(seq, ready, plan)
            self.scheduler.requeue(seq, out)  # frees its blocks; loaded ones were never indexed
            seq.num_cached_tokens = None

    def abandon(self, loading: list[Sequence]) -> None:
        """(the step failed before ``settle``) The failure is about to free these requests'
        blocks while their loads may still be writing: park the load targets first."""
        for seq in loading:
            ready, plan = seq.offload.readiness, seq.offload.load
            seq.offload.readiness = seq.offload.load = None
            if ready is not None and plan is not None:
                self._park_unfinished(seq, ready, plan)

    def _park_unfinished(self, seq: Sequence, ready: LayerReadiness, plan: ReusePlan) -> None:
        """Hold an extra reference on the load's target blocks until its RPC has ended (the
        kvstore may write them until then), so no other sequence can be given them."""
        if not ready.finished:
            ids = [b for b in plan.target_ids(
                self.kv.table_slice(seq, plan.first_block, plan.end_block), self.kv.num_layers)
                if b != SKIP]  # (blocks on device already are not written)
            self.kv.pool.touch(ids)
            self.parked.append((ready, ids))

    def unpark(self) -> None:
        """Release parked blocks whose load RPC has ended."""
        if not self.parked:
            return
        keep = []
        for ready, ids in self.parked:
            if ready.finished:
                self.kv.pool.free(ids)
            else:
                keep.append((ready, ids))
        self.parked = keep

    def drop_plan(self, seq: Sequence) -> None:
        """``seq`` leaves before admission: give its lease back."""
        plan, seq.offload.plan = seq.offload.plan, None
        if plan is not None and plan.lease_id and self.transport is not None:
            self.transport.release(plan.lease_id)

    # ---- saves --------------------------------------------------------------------------
    def save(self, seq: Sequence) -> None:
        """(request end) Hand ``seq``'s full computed blocks not saved yet to the kvstore;
        they stay pinned (one more reference) until ``unpin`` with the job's id."""
        if seq.no_reuse:
            return
        full = seq.num_computed_tokens // self.kv.block_size
        # From the first block not known saved: a mid-generation save still unanswered may
        # yet fail, and this is the sequence's last chance (its chunks already stored are
        # skipped by the kvstore without a copy).
        first = min([seq.offload.saved_blocks, *(f for s, f in self._saving.values() if s is seq)])
        if self.transport is not None and full > first:
            self._save_range(seq, first, full, seq.num_computed_tokens)

    def save_filled_chunks(self, seqs: list[Sequence]) -> None:
        """(during generation) Save the chunks that filled up since the last save:

            blocks: | saved ........ | new full chunks ....... | partial chunk | ...
                    0          saved_blocks             end (multiple of bpc)
        """
        bpc = self.blocks_per_chunk
        if self.transport is None or bpc <= 0:
            return
        for seq in seqs:
            if seq.no_reuse or seq.num_computed_tokens <= seq.num_prompt_tokens:
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
        self.kv.pool.touch(ids)
        job = SaveJob(next(self._job_ids), seq.tenant, seq.session_id,
                      tuple(seq.block_hashes[:end]), tokens, first, tuple(ids))
        self.pinned[job.job_id] = ids
        self._saving[job.job_id] = (seq, first)
        assert self.transport is not None  # (the callers checked)
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
            self.kv.pool.free(reversed(ids))  # later layers first: evicted first

    # ---- accounting ---------------------------------------------------------------------
    def held_blocks(self) -> list[int]:
        """Block references held here (pins and parked loads), one entry per reference."""
        out = [b for ids in self.pinned.values() for b in ids]
        out.extend(b for _, ids in self.parked for b in ids)
        out.extend(self.prefetch.held_blocks())
        return out

    def stats(self) -> ReuseStats:
        return ReuseStats(
            device_tokens=self.device_tokens,
            loaded_tokens=dict(self.loaded_tokens),
            recomputed_tokens=self.recomputed_tokens,
            load_failures=self.load_failures,
            last_load_seconds=self.last_load_s,
            prefetch=self.prefetch.stats(),
        )


def offload_for(config: EngineConfig, kv: BlockTables, scheduler: Scheduler,
                block_bytes: int = 0) -> KVStoreOffload:
    """The node's kvstore as ``config`` asks for it, over a core's block tables (of
    ``block_bytes`` per block: what prefetch statistics count in)."""
    return KVStoreOffload(
        kv,
        scheduler,
        whole_prefix=config.offload.mode == WHOLE_PREFIX,
        load_timeout_s=config.offload.load_timeout_s,
        prefill_prior_s_per_token=config.offload.prefill_s_per_token,
        pool_on_cpu=torch.device(config.device).type == "cpu",
        block_bytes=block_bytes,
        cooperative=config.offload.cooperative,
        purge_order=config.offload.purge_order,
    )


def loaded_from(plan: ReusePlan) -> str:
    """Where a plan's KV came from, the farthest source counting: "peer" (another node's
    kvstore), "s3" (the shared durable tier) or "local" (this node's DRAM or SSD)."""
    tiers = {s.tier for s in plan.spans}
    return "peer" if "peer" in tiers else "s3" if "s3" in tiers else "local"
