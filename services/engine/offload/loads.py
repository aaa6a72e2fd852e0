"""Loads of a request's stored prefix into its device blocks, overlapped with the forward
pass layer by layer (DESIGN §3, steps 5 and 6; Symphony §3.4). Worker thread only.

    admission (scheduler)  blocks [device, end) allocated in every layer, counted computed
    start(out)             a LoadJob per loading sequence ──► transport (event loop)
    forward pass           waiter: wait_for_layer(l) until layer l of every load is resident
    settle(out)            all layers ok: the blocks are indexed as usual | a layer failed:
                           the loaded blocks are never indexed, the request goes back to be
                           recomputed (the caller requeues what ``settle`` returns)

Blocks a failed load may still be writing into (its RPC has not ended) are *parked*: held
by an extra reference until the readiness says the RPC finished, so no other sequence can
be given them meanwhile.
"""

from __future__ import annotations

import logging

import torch

from services.engine.kvcache.block_tables import BlockTables
from services.engine.layer_readiness import LayerReadiness
from services.engine.offload.boundary import LayerWait
from services.engine.offload.cost_model import PrefillRate
from services.engine.offload.jobs import LoadJob
from services.engine.offload.transport import KVTransport
from services.engine.reuse_plan import SKIP, ReusePlan
from services.engine.scheduler import SchedulerOutput
from services.engine.sequence import Sequence

log = logging.getLogger(__name__)


class Loads:
    def __init__(self, kv: BlockTables, transport: KVTransport, *, whole_prefix: bool,
                 load_timeout_s: float, prefill_prior_s_per_token: float,
                 pool_on_cpu: bool = True) -> None:
        self.kv = kv
        self.transport = transport
        self.whole_prefix = whole_prefix
        self.pool_on_cpu = pool_on_cpu  # the kvstore's copies compete with the forward pass
        self.load_timeout_s = load_timeout_s
        self.prefill_rate = PrefillRate(prefill_prior_s_per_token)
        self.parked: list[tuple[LayerReadiness, list[int]]] = []
        self.loaded_tokens: dict[str, int] = {}  # by tier
        self.load_failures = 0
        self.last_load_s = 0.0  # admission to last layer resident, of the latest load
        self._restore_threads = 0  # intra-op threads to restore after an overlapped step
        self._loading: list[Sequence] = []  # this step's loads, from start to settle

    # ---- around the forward pass --------------------------------------------------------
    def release_unused(self, out: SchedulerOutput) -> None:
        """Admitted requests whose plan is not loaded (the device had it all, or a gap
        opened) give their lease back; every admitted plan is consumed."""
        loading = {id(seq) for seq, _ in out.loads}
        for seq, _ in out.admitted:
            plan, seq.offload.plan = seq.offload.plan, None
            if plan is not None and plan.lease_id and id(seq) not in loading:
                self.transport.release(plan.lease_id)

    def start(self, out: SchedulerOutput) -> list[Sequence]:
        """Hand this step's loads to the transport; the sequences now loading."""
        loading = []
        layers = self.kv.num_layers
        for seq, plan in out.loads:
            ready = LayerReadiness(layers)
            seq.offload.readiness, seq.offload.load = ready, plan
            loading.append(seq)
            ids = plan.target_ids(self.kv.table_slice(seq, plan.first_block, plan.end_block),
                                  layers)
            self.transport.start_load(LoadJob(seq.request_id, seq.tenant, plan, tuple(ids),
                                              ready))
        self._loading = loading
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

    def abandon(self) -> None:
        """(the step failed before ``settle``) The failure is about to free these requests'
        blocks while their loads may still be writing: park the load targets first."""
        loading, self._loading = self._loading, []
        for seq in loading:
            ready, plan = seq.offload.readiness, seq.offload.load
            seq.offload.readiness = seq.offload.load = None
            if ready is not None and plan is not None:
                self._park_unfinished(seq, ready, plan)

    # ---- after the forward pass ---------------------------------------------------------
    def settle(self, out: SchedulerOutput, seconds: float) -> list[Sequence]:
        """After the step: count complete loads; the failed ones, whose output must be
        neither indexed nor sampled: the caller requeues them to be recomputed."""
        loading, self._loading = self._loading, []
        if not loading:  # waits for loads would distort the measured compute rate
            self.prefill_rate.observe(out.total_tokens, seconds)
        failed = []
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
            self._park_unfinished(seq, ready, plan)  # (before the requeue frees its blocks)
            seq.num_cached_tokens = None  # counted again at its next admission
            failed.append(seq)
        return failed

    def _park_unfinished(self, seq: Sequence, ready: LayerReadiness, plan: ReusePlan) -> None:
        """Hold an extra reference on the load's target blocks until its RPC has ended (the
        kvstore may write them until then), so no other sequence can be given them."""
        if not ready.finished:
            ids = [b for b in plan.target_ids(
                self.kv.table_slice(seq, plan.first_block, plan.end_block), self.kv.num_layers)
                if b != SKIP]  # (blocks on device already are not written)
            self.kv.blocks.touch(ids)
            self.parked.append((ready, ids))

    def unpark(self) -> None:
        """Release parked blocks whose load RPC has ended."""
        if not self.parked:
            return
        keep = []
        for ready, ids in self.parked:
            if ready.finished:
                self.kv.blocks.free(ids)
            else:
                keep.append((ready, ids))
        self.parked = keep

    def drop_plan(self, seq: Sequence) -> None:
        """``seq`` leaves before admission: give its lease back."""
        plan, seq.offload.plan = seq.offload.plan, None
        if plan is not None and plan.lease_id:
            self.transport.release(plan.lease_id)

    def held_blocks(self) -> list[int]:
        """Block references held by parked loads, one entry per reference."""
        return [b for _, ids in self.parked for b in ids]


def loaded_from(plan: ReusePlan) -> str:
    """Where a plan's KV came from, the farthest source counting: "peer" (another node's
    kvstore), "s3" (the shared durable tier) or "local" (this node's DRAM or SSD)."""
    tiers = {s.tier for s in plan.spans}
    return "peer" if "peer" in tiers else "s3" if "s3" in tiers else "local"
