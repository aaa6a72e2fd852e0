"""The nodemgr's Reuse Store from its config: the arena, its hold on the node's device
ledger, the catalogue indexed in the background; and the store's /metrics gauges."""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack

from services.nodemgr.config import NodeManagerConfig
from services.nodemgr.reuse_store.arena import open_arena
from services.nodemgr.reuse_store.fingerprint import index_model
from services.nodemgr.reuse_store.store import ReuseStore
from shared.config import ConfigError
from shared.device_ledger import DeviceLedger
from shared.model_catalog import ModelEntry

log = logging.getLogger(__name__)


async def open_store(config: NodeManagerConfig, catalog: tuple[ModelEntry, ...],
                     stack: AsyncExitStack) -> ReuseStore:
    """The store, closed with ``stack``; the catalogue's models are fingerprinted in a
    background thread (an activation indexes its own model first if it comes sooner)."""
    ledger: DeviceLedger | None = None
    if config.device_ledger:
        ledger = DeviceLedger(config.device_ledger)
        if config.reuse_store_bytes > ledger.budget_bytes:
            ledger.close()
            raise ConfigError(f"nodemgr.reuse_store_bytes: {config.reuse_store_bytes} is more "
                              f"than the node's device budget ({ledger.budget_bytes}); set it "
                              "at most to the budget (the arena lives inside it)")
        ledger.join("reuse-store")
        stack.callback(ledger.close)
    arena = open_arena(config.weights_device, config.reuse_store_bytes, config.reuse_store_dir,
                       config.node_id)
    stack.callback(arena.close)
    store = ReuseStore(arena, ledger, config.weights_dtype)

    async def index_all() -> None:
        for entry in catalog:
            if entry.name in store.indexes:
                continue
            try:
                idx = await asyncio.to_thread(index_model, entry.name, entry.path,
                                              store.dtype)
            except (OSError, ValueError, KeyError) as e:
                log.warning("reuse store: cannot index %s at %s: %s", entry.name,
                            entry.path, e)
                continue
            store.indexes.setdefault(entry.name, idx)

    task = asyncio.create_task(index_all(), name="reuse-store-index")

    async def stop() -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    stack.push_async_callback(stop)
    log.info("reuse store: %d MiB arena at %s", arena.nbytes >> 20, arena.path)
    return store


def store_gauges(store: ReuseStore) -> dict[str, float]:
    """Node-wide gauges (``overture_nodemgr_reuse_*``); counters only ever grow."""
    s = store.stats
    return {"reuse_resident_bytes": float(store.resident_bytes()),
            "reuse_shared_bytes": float(store.shared_bytes()),
            "reuse_arena_committed_bytes": float(store.arena.resident_bytes()),
            "reuse_hits": float(s.hits), "reuse_hit_bytes": float(s.hit_bytes),
            "reuse_loads": float(s.loads), "reuse_loaded_bytes": float(s.loaded_bytes),
            "reuse_evictions": float(s.evictions),
            "reuse_evicted_bytes": float(s.evicted_bytes),
            "reuse_packings": float(s.packings), "reuse_packing_seconds": s.packing_seconds,
            "reuse_compactions": float(s.compactions),
            "reuse_moved_bytes": float(s.moved_bytes),
            "reuse_compaction_seconds": s.compaction_seconds,
            "reuse_load_bytes_per_s": store.load_bytes_per_s()}


def model_gauges(store: ReuseStore) -> list[tuple[str, dict[str, float]]]:
    """Per model: its weight bytes resident in the arena (its own or shared) and total."""
    return [(r.model, {"resident_weight_bytes": float(r.resident_bytes),
                       "total_weight_bytes": float(r.total_bytes)})
            for r in store.residency()]
