"""The model an engine serves, as a slot that outlives it (Prism §5.2).

An engine process starts (its worker thread, OpenMP team, gRPC server and imports, the
slow part of a cold start) with or without a model; ``activate`` loads one into it and
``evict`` frees the model's KV pool and weights while the engine stays for the next. With
the node's device ledger (``shared/device_ledger.py``) the weights count against the
node's one budget, which the KV pages of every engine of the node share.

    serve:  hold the weights ─► EngineCore (worker thread; its KV pool laid out for the
            model, its offload built by the KVStoreLink) ─► start the link ─► step it
    stop:   halt stepping ─► close the link ─► end every stream ─► close the core

The slot owns the loaded model, its guidance, the core, the kvstore link and the hold on
the ledger; the worker runs what touches the core.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
from typing import Protocol

import torch

from shared.device_ledger import DeviceLedger

from .api_types import EngineStatus, ModelInfo
from .config import EngineConfig
from .engine_core import EngineCore
from .errors import INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE, EngineError
from .guidance import ModelGuidance
from .loading import DTYPES, load_for
from .model import LoadedModel
from .model.arena_layout import ArenaLayouts
from .model.mapped import StoredWeights, load_mapped
from .offload import RECOMPUTE, KVStoreLink, ReusePlanner
from .worker import InboxAnswers, Worker

log = logging.getLogger(__name__)


class Streams(Protocol):
    def fail_all(self, error: EngineError) -> None: ...


class ModelSlot:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None, worker: Worker,
                 streams: Streams) -> None:
        self.config = config  # the served model's (``activate`` replaces its model_path)
        self.loaded = loaded
        self.guidance: ModelGuidance | None = None
        self.core: EngineCore | None = None
        self.link: KVStoreLink | None = None  # the node's kvstore, while serving
        self.planner: ReusePlanner | None = None  # the link's, while serving
        self._worker = worker
        self._streams = streams
        self._ledger: DeviceLedger | None = None  # the node's shared budget
        self._weights_held = 0
        self.shared_weights = False  # the weights are views into the node's arena
        self._layouts = ArenaLayouts()  # oneDNN's layouts in the arena, known per shape
        self.last_fill = (0, 0.0)  # (bytes, seconds) the last activation wrote there
        # Two activations at once would both load, the second replacing the first
        # unreleased: activate and evict hold it.
        self._switch_lock = asyncio.Lock()

    @property
    def switching(self) -> bool:
        """A model is being activated or evicted."""
        return self._switch_lock.locked()

    # ---- the engine's start and stop ----------------------------------------------------
    async def load_configured(self) -> None:
        """Load ``config.model_path`` (unless a model was given, or the engine starts as a
        standby one without it)."""
        if self.loaded is None and (self.config.model_path or not self.config.standby):
            # Loaded in the worker as well: each thread that runs parallel torch ops keeps its
            # own OpenMP team, and with more team threads than cores libgomp stops spinning
            # between parallel regions; that doubled one-row decode steps on 2 cores.
            self.loaded = await self._worker.run(load_for, self.config)

    async def open(self) -> None:
        """Join the node's ledger; serve the loaded model, if any."""
        if self.config.device_ledger:
            self._ledger = DeviceLedger(self.config.device_ledger)
            self._ledger.join()
        if self.loaded is not None:
            await self._serve()
        else:
            log.info("engine started without a model: waiting for one to be activated")

    async def close(self, why: str) -> None:
        await self._stop_serving(why)
        self._release_weights()
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None

    # ---- activation ---------------------------------------------------------------------
    async def activate(self, model_path: str, served_name: str = "",
                       stored: StoredWeights | None = None) -> ModelInfo:
        """Serve ``model_path`` in this running engine (Prism §5.2: the engine outlives
        the model). Its weights load from the page cache when the node's weight cache
        holds them; with ``stored`` they are views into the node's weight arena (Tangram
        §3.1), the missing ones written there first, and the arena's owner counts them
        in the node's budget. The model already active is kept if it is the same, else
        refused."""
        if not self._worker.running:
            raise EngineError(UNAVAILABLE, "the engine is not running")
        async with self._switch_lock:  # (a second caller then finds this one's model)
            if self.core is not None:
                if self.loaded is not None and str(self.loaded.path) == str(model_path):
                    return self.core.model_info
                raise EngineError(INVALID_ARGUMENT, f"{self.core.model_info.name!r} is "
                                  "active here; evict it before activating another model")
            config = dataclasses.replace(self.config, model_path=model_path,
                                         served_model_name=served_name)
            if stored is not None and config.dtype in ("q4", "q8_0"):
                # The Reuse Store holds float tensors; a quantized engine keeps its own codes.
                raise EngineError(INVALID_ARGUMENT, f"engine dtype {config.dtype} cannot serve "
                                  "weights from the node's Reuse Store (it holds float "
                                  "tensors): set nodemgr.reuse_store_bytes to 0 for this node")
            try:
                if stored is None:
                    loaded = await self._worker.run(load_for, config)
                else:
                    got = await self._worker.run(load_mapped, model_path, stored,
                                                 DTYPES[config.dtype], served_name,
                                                 self._layouts)
                    loaded, self.last_fill = got.loaded, (got.filled_bytes, got.fill_seconds)
            except Exception as e:  # (a bad folder is the caller's mistake, not a crash)
                raise EngineError(INVALID_ARGUMENT,
                                  f"cannot load {model_path}: {e}") from None
            self.config, self.loaded = config, loaded
            self.shared_weights = stored is not None
            core = await self._serve()
            return core.model_info

    async def evict(self) -> bool:
        """Stop serving the active model: its requests end (UNAVAILABLE), its KV pool and
        weights are freed; the worker stays for the next ``activate``. Whether one was."""
        async with self._switch_lock:
            core = self.core
            if core is None:
                return False
            await self._stop_serving("the model was evicted from this engine")
            self._release_weights()
            self.loaded = self.guidance = None
            self.shared_weights = False
            await self._worker.run(gc.collect)
            log.info("evicted %s", core.model_info.name)
            return True

    # ---- serving ------------------------------------------------------------------------
    async def _serve(self) -> EngineCore:
        """Build the core (its KV pool laid out for the loaded model, its offload the node's
        kvstore), start stepping. With a node ledger the weights are counted first."""
        loaded = self.loaded
        assert loaded is not None
        self._hold_weights(loaded)
        o = self.config.offload
        link = (KVStoreLink(self.config, loaded, InboxAnswers(self._worker), self._worker)
                if o.kvstore_address and o.mode != RECOMPUTE else None)
        try:
            core = await self._worker.run(EngineCore, self.config, loaded, self._ledger,
                                          link.build_offload if link is not None else None)
        except BaseException:
            self._release_weights()
            raise
        self.core = core
        self.guidance = ModelGuidance(loaded.tokenizer, loaded.config.vocab_size,
                                      loaded.config.eos_token_ids, self.config.tool_parser)
        if link is not None:
            # Before stepping starts: the worker reaches the kvstore only while stepping.
            await link.start()
            self.link, self.planner = link, link.planner
        await self._worker.serve(core)
        info = core.model_info
        log.info("engine serving %s: context %d, KV pool %d blocks of %d bytes at %s",
                 info.name, info.max_model_len, core.pool.num_blocks, core.pool.block_bytes,
                 core.pool.name)
        return core

    async def _stop_serving(self, why: str) -> None:
        core = self.core
        await self._worker.halt()  # the stepping run ends after its current step
        if self.link is not None:
            await self.link.close()
            self.link = self.planner = None
        self._streams.fail_all(EngineError(UNAVAILABLE, why))
        if self._worker.running and core is not None:
            await self._worker.run(core.close)
        self.core = None
        self._worker.detach()

    # ---- the node's ledger --------------------------------------------------------------
    def _hold_weights(self, loaded: LoadedModel) -> None:
        """Count the weights against the node's budget (RESOURCE_EXHAUSTED: no room)."""
        if self._ledger is None or self.shared_weights:  # (the arena's owner counts those)
            return
        nbytes = weight_bytes(loaded.model)
        self._ledger.label(loaded.name)
        if not self._ledger.take(nbytes, weights=True):
            free = self._ledger.available_bytes(weights=True)
            raise EngineError(RESOURCE_EXHAUSTED, f"the node's device budget has "
                              f"{free >> 20} MiB free, {loaded.name} needs "
                              f"{nbytes >> 20} MiB for its weights; evict a model first")
        self._weights_held = nbytes

    def _release_weights(self) -> None:
        if self._ledger is not None and self._weights_held:
            self._ledger.give(self._weights_held, weights=True)
            self._ledger.label("")
        self._weights_held = 0


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights on the device: its own count where it keeps weights
    outside its parameters (packed or quantized linears), else parameters and buffers."""
    own = getattr(model, "weight_bytes", None)
    if isinstance(own, int):
        return own
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def idle_status(config: EngineConfig) -> EngineStatus:
    """The status of an engine serving no model (a standby one, or one between models)."""
    return EngineStatus(models=(), blocks_total=0, blocks_free=0, blocks_used=0,
                        blocks_evictable=0, blocks_committed=0, running=0, waiting=0,
                        device_budget_bytes=config.device_memory_bytes, block_bytes=0,
                        device=config.device, pool_name="")
