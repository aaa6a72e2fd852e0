"""Remapping in an engine: the controller (Algorithm 1) over this engine's KV pool, and
the streamer that runs the forward with the layers it lends (MIRAGE §4.2's workflow).

    EngineCore.step
      Remapper.before_step     pending KV demand vs what the allocator can hand out
        controller.step()      -> α: lend one more layer, or give the emptied ones back
        streamer.install(plan) when α or the scheme changed (uniform layers, β slots)
      scheduler.schedule       allocates KV, in the lent pages too
      forward                  streamed layers computed in their slots
      Remapper.after_forward   the measured compute time per layer (Equations 4/5, §5.3)

The give-way order under pressure (``engine.remap.give_way``, ``shared/give_way.py``): by
default the device prefetch's KV first (the allocator's reclaimer purges it, later layers
first, before any demand counts as unmet), then idle models' weights (on a node's budget
this engine waits ``node_grace_s`` while the broker takes them), then the active model's
own layers (the controller). The node's broker lends idle engines' layers to the node's
budget through ``lend_to_node`` (§5.2 across the node).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from shared.give_way import parse_give_way

from ..api_types import RemapStatus
from ..config import RemapConfig
from ..kvcache.block_allocator import BlockAllocator, Reclaimer
from ..kvcache.device_memory import DeviceMemory
from ..model.llama import LlamaModel
from ..model.quant import QuantLinear
from .controller import RemappingController, RemapTarget
from .layer_choice import choose_slots, max_alpha, plan_layers
from .streamer import LayerStreamer, layer_bytes
from .transfer import SlotCopier, make_copier

EMA = 0.2  # weight of the newest measurement in the per-layer times


class PoolLender:
    """The engine's KV pool as the controller's ``KvLender``. On a node's shared budget,
    KV counts as running out only once it has stayed short ``grace_s``: the node's broker
    polls every 0.1 s and first takes back idle engines' pages and the Reuse Store's
    inactive weights (idle models give way before the active one's layers)."""

    def __init__(self, pool: DeviceMemory, blocks: BlockAllocator,
                 demand: Callable[[], int], reclaimable: Callable[[], int],
                 grace_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._pool, self._blocks = pool, blocks
        self._demand, self._reclaimable = demand, reclaimable
        self._grace_s = grace_s if pool.shares_budget else 0.0
        self._clock = clock
        self._short_since: float | None = None

    def running_out(self) -> bool:
        # Prefetched KV the allocator can purge counts as available: it gives way first.
        short = self._demand() > self._blocks.num_available() + self._reclaimable()
        if not short:
            self._short_since = None
            return False
        now = self._clock()
        if self._short_since is None:
            self._short_since = now
        return now - self._short_since >= self._grace_s

    def lend(self, nbytes: int) -> None:
        self._pool.lend(nbytes)

    def reclaim(self, nbytes: int) -> bool:
        pool = self._pool
        limit = (pool.budget_bytes + pool.lent_bytes - nbytes) // pool.page_span
        if not self._blocks.release_from(limit):
            return False
        return pool.take_back(nbytes)


def remappable(model: LlamaModel) -> bool:
    """Float models only: a quantized layer has no plain weights to stream."""
    layer = model.decoder_layers[0] if model.decoder_layers else None
    return layer is not None and not any(
        isinstance(getattr(layer, n), QuantLinear) for n in ("qkv", "o", "gate_up", "down"))


def lendable_bytes(config: RemapConfig, model: LlamaModel) -> int:
    """The most weight bytes the engine may lend (address space its pool reserves)."""
    if not config.enabled or not remappable(model):
        return 0
    n = len(model.decoder_layers)
    return max_alpha(n, config.max_fraction) * layer_bytes(model.decoder_layers[0])


class Remapper:
    def __init__(self, config: RemapConfig, model: LlamaModel, name: str,
                 pool: DeviceMemory, blocks: BlockAllocator, demand: Callable[[], int],
                 reclaimer: Reclaimer | None = None, copier: SlotCopier | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``demand``: KV blocks the next step needs (the scheduler's pending demand);
        ``reclaimer``: who holds prefetched KV, which gives way before weights do."""
        self.config = config
        self.num_layers = len(model.decoder_layers)
        self.give_way = parse_give_way(config.give_way)
        purgeable = reclaimer.reclaimable if reclaimer is not None and \
            self.give_way.prefetch_first else (lambda: 0)
        grace = config.node_grace_s if self.give_way.idle_first else 0.0
        self.lender = PoolLender(pool, blocks, demand, purgeable, grace, clock)
        self.controller = RemappingController(self.lender)
        self.target = RemapTarget(name, self.num_layers, layer_bytes(model.decoder_layers[0]),
                                  cap=max_alpha(self.num_layers, config.max_fraction))
        self.controller.add(self.target)
        self.streamer = LayerStreamer(model, copier or make_copier(str(model.device)))
        self.t_compute: float | None = None  # per layer, seconds (EMA)
        self._pool = pool
        self.node_layers = 0  # layers whose weight memory the node's budget holds

    @property
    def t_transfer(self) -> float | None:
        """Measured seconds to copy one layer into its slot (mean of recent copies)."""
        recent = self.streamer.stats.per_layer_s
        return sum(recent) / len(recent) if recent else None

    def before_step(self) -> None:
        """Algorithm 1 for this step, and the forward's plan to match."""
        self.streamer.begin_step()
        self.settle()

    def settle(self) -> None:
        """Algorithm 1 once (also after a step that left no work: the lent layers whose
        KV is empty come back without waiting for another request)."""
        n, t_t, t_c = self.num_layers, self.t_transfer, self.t_compute
        cap = (max_alpha(n, self.config.max_fraction, t_t, t_c)
               if self.config.capped else max_alpha(n, self.config.max_fraction))
        self.target.cap = max(0, cap - self.node_layers)  # (layers the node holds count)
        self.controller.step()
        self._install()

    def _install(self) -> None:
        """The forward's plan for every layer lent: to this engine's KV and to the node's."""
        n, t_t, t_c = self.num_layers, self.t_transfer, self.t_compute
        alpha = self.target.alpha + self.node_layers
        slots = choose_slots(alpha, n, t_t, t_c, self.config.scheme) if alpha else 0
        plan = self.streamer.plan
        if (alpha, slots) != (plan.alpha, plan.slots):
            self.streamer.install(plan_layers(alpha, n, t_t, t_c, self.config.scheme))

    def lendable_layers(self) -> int:
        """More layers this engine could lend now (its cap, §5.2/§5.3, less those lent)."""
        cap = max_alpha(self.num_layers, self.config.max_fraction)
        return max(0, min(cap, self.num_layers - 1) - self.target.alpha - self.node_layers)

    def lend_to_node(self, layers: int) -> int:
        """MIRAGE §5.2 across the node: the node's broker asks this engine (an idle or
        low-priority model) to lend ``layers`` more layers' weight memory to the node's
        budget (< 0: take back that many, newest first, as far as the budget has the
        bytes free again). The layers are streamed from then on. Layers lent now."""
        step = self.target.layer_bytes
        for _ in range(max(0, layers)):
            if self.lendable_layers() <= 0 or not self._pool.lend_to_node(step):
                break
            self.node_layers += 1
        for _ in range(max(0, -layers)):
            if self.node_layers <= 0 or not self._pool.take_back_from_node(step):
                break
            self.node_layers -= 1
        self._install()
        return self.node_layers

    def after_forward(self, seconds: float) -> None:
        """The forward's wall time: its resident layers' compute time, per layer."""
        self.streamer.end_forward()
        per_layer = seconds / self.num_layers
        self.t_compute = per_layer if self.t_compute is None else (
            (1 - EMA) * self.t_compute + EMA * per_layer)

    def stats(self) -> RemapStatus:
        s, p = self.streamer.stats, self.streamer.plan
        return RemapStatus(p.alpha, p.slots, p.layers, self.controller.lent_bytes,
                          self.controller.remaps, self.controller.reversions, s.transfers,
                          s.transfer_s, s.step_transfer_s, s.stalled_forwards,
                          node_layers=self.node_layers,
                          node_lent_bytes=self._pool.node_lent_bytes,
                          lendable_layers=self.lendable_layers(),
                          layer_bytes=self.target.layer_bytes, give_way=str(self.give_way))

    def close(self) -> None:
        self.lend_to_node(-self.node_layers)  # (what the budget cannot return, the
        # weights' release on eviction settles: the ledger never counts below zero)
        self.streamer.install(plan_layers(0, self.num_layers))
        self.streamer.close()
