"""The node's kvstore behind the core's offload boundary (DESIGN §3, steps 5, 6, 8): the
worker-thread side, composed of three parts that never block on the network (their RPCs
run on the event loop behind a ``KVTransport`` whose calls only post work there):

    loads     (loads.py)             a request's stored prefix, layer by layer
    saves     (saves.py)             its computed blocks, pinned until answered
    prefetch  (device_prefetch/)     advised sessions' KV into free device blocks

This class only routes the boundary's points to them and adds up their statistics.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from services.engine.api_types import ReuseStats
from services.engine.config import EngineConfig
from services.engine.kvcache.block_allocator import Reclaimer
from services.engine.kvcache.block_tables import BlockTables
from services.engine.offload.boundary import LayerWait, Offload
from services.engine.offload.cost_model import WHOLE_PREFIX
from services.engine.offload.device_prefetch import (
    DevicePrefetch,
    LoadWatch,
    PrefetchOrder,
    RequestDemand,
)
from services.engine.offload.loads import Loads
from services.engine.offload.saves import Saves
from services.engine.offload.transport import KVTransport
from services.engine.reuse_plan import ReusePlan
from services.engine.scheduler import SchedulerOutput
from services.engine.sequence import Sequence
from shared.session_key import SessionKey


class KVStoreOffload(Offload):
    def __init__(self, loads: Loads, saves: Saves, prefetch: DevicePrefetch) -> None:
        super().__init__()
        self.loads = loads
        self.saves = saves
        self.prefetch = prefetch

    # ---- the boundary -------------------------------------------------------------------
    def accept(self, plan: ReusePlan | None) -> ReusePlan | None:
        return plan

    def begin_step(self) -> None:
        self.loads.unpark()
        self.prefetch.begin_step()

    def add_prefetch(self, order: PrefetchOrder) -> None:
        self.prefetch.add(order)
        self.prefetch.fill()  # now: a request right behind it finds the load in flight

    def end_prefetch(self, session: SessionKey, expired: bool) -> bool:
        return self.prefetch.end(session, expired)

    @contextmanager
    def forward(self, out: SchedulerOutput) -> Iterator[LayerWait | None]:
        self._count_admissions(out)
        for seq, _ in out.admitted:
            self.prefetch.admitted(seq)
        self.loads.release_unused(out)
        loading = self.loads.start(out)
        try:
            yield self.loads.waiter(loading)
        except BaseException:
            self.loads.abandon()  # before the failure frees the requests' blocks
            raise
        finally:
            self.loads.end_forward()

    def after_forward(self, out: SchedulerOutput, seconds: float) -> list[str]:
        redo = [seq.request_id for seq in self.loads.settle(out, seconds)]
        self._count_computed(out, redo)
        return redo

    def after_sample(self, seqs: list[Sequence]) -> None:
        self.saves.save_filled_chunks(seqs)

    def finished(self, seq: Sequence) -> None:
        self.saves.save(seq)  # pins its full blocks until the kvstore has them

    def dropped(self, seq: Sequence) -> None:
        self.loads.drop_plan(seq)

    def unpin(self, job_id: int, ok: bool = True) -> None:
        self.saves.unpin(job_id, ok)

    def attached(self, blocks_per_chunk: int) -> None:
        self.saves.blocks_per_chunk = blocks_per_chunk  # where mid-generation saves cut

    @property
    def reclaimer(self) -> Reclaimer | None:
        return self.prefetch if self.prefetch.cooperative else None

    @property
    def holds_blocks(self) -> bool:
        return bool(self.saves.pinned or self.loads.parked) or self.prefetch.loading

    def fill_pending(self) -> bool:
        return self.prefetch.fill_pending()

    # ---- accounting ---------------------------------------------------------------------
    def held_blocks(self) -> list[int]:
        """Block references held here (pins, parked loads, prefetch), one per reference."""
        return [*self.saves.held_blocks(), *self.loads.held_blocks(),
                *self.prefetch.held_blocks()]

    def stats(self) -> ReuseStats:
        loads = self.loads
        return ReuseStats(
            device_tokens=self.device_tokens,
            loaded_tokens=dict(loads.loaded_tokens),
            recomputed_tokens=self.recomputed_tokens,
            load_failures=loads.load_failures,
            last_load_seconds=loads.last_load_s,
            prefill_s_per_token=loads.prefill_rate.value,
            prefetch=self.prefetch.stats(),
        )


def offload_for(config: EngineConfig, kv: BlockTables, demand: RequestDemand,
                block_bytes: int, transport: KVTransport,
                watch: LoadWatch | None = None) -> KVStoreOffload:
    """The node's kvstore as ``config`` asks for it, over a core's block tables (of
    ``block_bytes`` per block: what prefetch statistics count in), reached through
    ``transport``; ``demand`` is the core's scheduler, ``watch`` hears of prefetch loads."""
    o = config.offload
    loads = Loads(kv, transport, whole_prefix=o.mode == WHOLE_PREFIX,
                  load_timeout_s=o.load_timeout_s,
                  prefill_prior_s_per_token=o.prefill_s_per_token,
                  pool_on_cpu=torch.device(config.device).type == "cpu")
    prefetch = DevicePrefetch(kv, block_bytes, transport, demand, watch=watch,
                              cooperative=o.cooperative, purge_order=o.purge_order)
    return KVStoreOffload(loads, Saves(kv, transport), prefetch)
