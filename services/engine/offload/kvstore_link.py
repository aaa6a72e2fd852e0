"""The node's kvstore for the model an engine serves: the event loop's side, built with the
engine core and closed with it.

    KVStoreLink(config, loaded, answers, steps)          on the event loop, cheap
    EngineCore(..., offload=link.build_offload)          worker thread: the core calls
        build_offload(kv, scheduler, pool)                 it over its own parts: the
            KVStoreClient(pool geometry)                   client, a LoopTransport to it,
            KVStoreOffload(loads, saves, prefetch)         the worker-side offload
    await link.start()                                   attaching in the background
    link.planner.plan(request)                           per request (reuse_planner.py)
    await link.find_session(...)                         per advisory: a PrefetchOrder
    await link.close()                                   saves drain, joins released

The worker-side offload talks back only through ``answers`` (commands for the worker's
inbox) and ``joins`` (the device prefetch's loads, posted to the loop).
"""

from __future__ import annotations

import asyncio
import dataclasses

from services.engine.api_types import ReuseStats
from services.engine.config import EngineConfig
from services.engine.kvcache.block_tables import BlockTables
from services.engine.kvcache.device_memory import DeviceMemory
from services.engine.model import LoadedModel
from services.engine.offload.device_prefetch import PrefetchOrder
from services.engine.offload.jobs import PoolGeometry
from services.engine.offload.kvstore_client import KVStoreClient
from services.engine.offload.kvstore_offload import KVStoreOffload, offload_for
from services.engine.offload.prefetch_joins import PrefetchJoins
from services.engine.offload.reuse_planner import ReusePlanner, StepSnapshots
from services.engine.offload.save_log import SavedSession
from services.engine.offload.transport import KVStoreAnswers, LoopTransport
from services.engine.reuse_plan import ReusePlan
from services.engine.scheduler import Scheduler
from shared.session_key import SessionKey


class KVStoreLink:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, answers: KVStoreAnswers,
                 steps: StepSnapshots) -> None:
        """(event loop) Cheap: nothing is built until the core calls ``build_offload``."""
        self.config = config
        self.loaded = loaded
        self._answers = answers
        self._steps = steps
        self._loop = asyncio.get_running_loop()
        self.joins = PrefetchJoins(self._loop)
        self._client: KVStoreClient | None = None
        self._planner: ReusePlanner | None = None

    def build_offload(self, kv: BlockTables, scheduler: Scheduler, pool: DeviceMemory
                      ) -> KVStoreOffload:
        """(worker thread, inside ``EngineCore()``: an ``OffloadFactory``) The client of
        the kvstore for this pool and the worker-side offload that reaches it."""
        mc = self.loaded.config
        geometry = PoolGeometry(
            pool_name=pool.name, device=self.config.device, num_blocks=pool.num_blocks,
            block_size=self.config.block_size, num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim, dtype=str(self.loaded.dtype).removeprefix("torch."),
            num_layers=mc.num_layers, model_fp=self.loaded.fingerprint,
        )
        client = KVStoreClient(self.config, geometry, on_attached=self._answers.attached)
        transport = LoopTransport(self._loop, client, self._answers)
        self._client = client
        self._planner = ReusePlanner(self.config, client, kv, self.joins, self._steps,
                                     mc.num_layers)
        return offload_for(self.config, kv, scheduler, pool.block_bytes, transport,
                           self.joins)

    @property
    def client(self) -> KVStoreClient:
        assert self._client is not None, "the core has not built its offload yet"
        return self._client

    @property
    def planner(self) -> ReusePlanner:
        assert self._planner is not None, "the core has not built its offload yet"
        return self._planner

    async def start(self) -> None:
        """Open the channel and attach the pool in the background."""
        await self.client.start()

    async def close(self) -> None:
        """Let saves in flight finish, then drop the channel; requests waiting to join a
        device prefetch go on without it."""
        self.joins.close()
        if self._client is not None:
            await self._client.close()

    async def find_session(self, session: SessionKey, priority: int, ttl_s: float,
                           straight: bool) -> PrefetchOrder | None:
        """What the kvstore holds of an advised session, as an order for the device
        prefetch (its lease held); None when nothing usable is stored."""
        found = await self.client.find_stored_session(session)
        if found is None:
            return None
        n = found.spans[-1].end_block
        hashes = found.block_hashes[:n]
        if found.spans[0].first_block != 0 or len(hashes) < n:
            self.client.release(found.lease_id)
            return None
        plan = ReusePlan(tuple(found.spans), found.lease_id, 0, n)
        return PrefetchOrder(session, hashes, plan, priority, ttl_s, straight)

    def release(self, plan: ReusePlan) -> None:
        self.client.release(plan.lease_id)

    def saved_after(self, seq: int) -> tuple[SavedSession, ...]:
        """Session saves that landed, numbered above ``seq`` (see ``save_log``)."""
        return self.client.saved.after(seq)

    def stats(self, core_stats: ReuseStats) -> ReuseStats:
        """The core's reuse counters with the client's."""
        c = self.client
        return dataclasses.replace(
            core_stats, mode=self.config.offload.mode, attached=c.attached,
            lookups=c.stats.lookups, lookup_errors=c.stats.lookup_errors,
            saves=c.stats.saves, save_errors=c.stats.save_errors,
            chunks_saved=c.stats.chunks_saved,
        )
