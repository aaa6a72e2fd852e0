"""The model an engine serves, as a slot that outlives it (Prism §5.2).

An engine process starts (its worker thread, OpenMP team, gRPC server and imports, the
slow part of a cold start) with or without a model; ``activate`` loads one into it and
``evict`` frees the model's KV pool and weights while the engine stays for the next. With
the node's device ledger (``shared/device_ledger.py``) the weights count against the
node's one budget, which the KV pages of every engine of the node share.

Mixed into ``AsyncEngine``, whose state (``_core``, ``_loaded``, ``_ledger``...) it uses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .api_types import EngineStatus, ModelInfo
from .config import EngineConfig
from .errors import INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE, EngineError
from .loading import load_for

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from shared.device_ledger import DeviceLedger

    from .engine_core import EngineCore

log = logging.getLogger(__name__)


class ModelSlot:
    config: EngineConfig
    _core: EngineCore | None
    _loaded: Any
    _guidance: Any
    _snapshot: EngineStatus | None
    _executor: ThreadPoolExecutor | None
    _ledger: DeviceLedger | None
    _weights_held: int
    _switch_lock: asyncio.Lock  # two activations at once would both load, the second
    # replacing the first unreleased: activate and evict hold it

    if TYPE_CHECKING:  # (provided by WorkerLoop and AsyncEngine)
        def _in_worker(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future: ...
        async def _serve_loaded(self) -> None: ...
        async def _stop_serving(self, why: str) -> None: ...
        def _require_core(self) -> EngineCore: ...

    async def activate(self, model_path: str, served_name: str = "") -> ModelInfo:
        """Serve ``model_path`` in this running engine (Prism §5.2: the engine outlives
        the model). Its weights load from the page cache when the node's weight cache
        holds them. The model already active is kept if it is the same, else refused."""
        if self._executor is None:
            raise EngineError(UNAVAILABLE, "the engine is not running")
        async with self._switch_lock:  # (a second caller then finds this one's model)
            if self._core is not None:
                if self._loaded is not None and str(self._loaded.path) == str(model_path):
                    return self._core.model_info
                raise EngineError(INVALID_ARGUMENT, f"{self._core.model_info.name!r} is "
                                  "active here; evict it before activating another model")
            config = dataclasses.replace(self.config, model_path=model_path,
                                         served_model_name=served_name)
            try:
                loaded = await self._in_worker(load_for, config)
            except Exception as e:  # (a bad folder is the caller's mistake, not a crash)
                raise EngineError(INVALID_ARGUMENT,
                                  f"cannot load {model_path}: {e}") from None
            self.config, self._loaded = config, loaded
            await self._serve_loaded()
            return self._require_core().model_info

    async def evict(self) -> bool:
        """Stop serving the active model: its requests end (UNAVAILABLE), its KV pool and
        weights are freed; the worker stays for the next ``activate``. Whether one was."""
        async with self._switch_lock:
            core = self._core
            if core is None:
                return False
            await self._stop_serving("the model was evicted from this engine")
            self._release_weights()
            self._loaded = self._guidance = self._snapshot = None
            await self._in_worker(gc.collect)
            log.info("evicted %s", core.model_info.name)
            return True

    def _hold_weights(self) -> None:
        """Count the weights against the node's budget (RESOURCE_EXHAUSTED: no room)."""
        if self._ledger is None:
            return
        nbytes = weight_bytes(self._loaded.model)
        self._ledger.label(self._loaded.name)
        if not self._ledger.take(nbytes, weights=True):
            free = self._ledger.available_bytes(weights=True)
            raise EngineError(RESOURCE_EXHAUSTED, f"the node's device budget has "
                              f"{free >> 20} MiB free, {self._loaded.name} needs "
                              f"{nbytes >> 20} MiB for its weights; evict a model first")
        self._weights_held = nbytes

    def _release_weights(self) -> None:
        if self._ledger is not None and self._weights_held:
            self._ledger.give(self._weights_held, weights=True)
            self._ledger.label("")
        self._weights_held = 0


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (what its weights hold on the device)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)



def idle_status(config: EngineConfig) -> EngineStatus:
    return EngineStatus(models=(), blocks_total=0, blocks_free=0, blocks_used=0,
                        blocks_evictable=0, blocks_committed=0, running=0, waiting=0,
                        device_budget_bytes=config.device_memory_bytes, block_bytes=0,
                        device=config.device, pool_name="")
