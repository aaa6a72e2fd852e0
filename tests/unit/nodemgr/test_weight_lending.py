"""MIRAGE §5.2 across a node: which engines the node's broker asks to lend layers' weight
memory under KV pressure (idle models first, then active ones lowest catalogue priority
first, pinned ones last), in the one give-way order the prefetcher follows too; and the
reversion after a burst."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.nodemgr.advisory_prefetcher import Advice, AdvisoryPrefetcher
from services.nodemgr.memory_broker import EngineMemory, MemoryBroker
from services.nodemgr.weight_lending import (
    Lender,
    catalog_rank,
    next_lender,
    revert_order,
    weights_lent,
)
from shared.config import ConfigError
from shared.give_way import GiveWay, parse_give_way
from shared.model_catalog import ModelEntry, load_catalog
from shared.proto import engine_pb2

ORDER = GiveWay()


def lender(name: str, running: int = 0, waiting: int = 0, priority: int = 0,
           pinned: bool = False, slo: float = 2.0, lendable: int = 2, lent: int = 0) -> Lender:
    return Lender(name, running, waiting, lendable, lent, priority, pinned, slo)


def test_inactive_models_lend_before_the_active_one_pinned_or_important_last() -> None:
    waiting = lender("w", running=4, waiting=3)
    idle, active = lender("idle"), lender("active", running=2)
    assert next_lender([waiting, active, idle], ORDER) == idle
    low, high = lender("low", running=1, priority=-1), lender("high", running=1, priority=5)
    assert next_lender([waiting, high, low], ORDER) == low
    pinned_idle = lender("pinned", pinned=True)
    assert next_lender([waiting, pinned_idle, high], ORDER) == high  # pinned: last of all
    assert next_lender([waiting, pinned_idle], ORDER) == pinned_idle
    # equal priority: the looser TTFT SLO (Prism's) lends first
    tight, loose = lender("tight", running=1, slo=0.5), lender("loose", running=1, slo=4.0)
    assert next_lender([waiting, tight, loose], ORDER) == loose
    # nobody waits, or none can lend: nobody is asked
    assert next_lender([idle, active], ORDER) is None
    assert next_lender([waiting, lender("full", lendable=0)], ORDER) is None
    # the order reversed by configuration: active models lend before idle ones
    active_first = parse_give_way("active_weights,idle_weights,prefetched_kv")
    assert next_lender([waiting, idle, active], active_first) == active
    # reversion: the most important first
    lent = [lender("a", lent=1, priority=-1), lender("b", lent=2, priority=3), idle]
    assert [e.name for e in revert_order(lent, ORDER)] == ["b", "a"]


def test_catalogue_priority_is_read_and_checked(tmp_path: Path) -> None:
    p = tmp_path / "models.yaml"
    p.write_text("models:\n  - {name: a, path: /m/a, priority: 3, pin: true}\n"
                 "  - {name: b, path: /m/b}\n")
    entries = {e.name: e for e in load_catalog(p)}
    assert catalog_rank("a", entries) == (3, True, 2.0)
    assert catalog_rank("b", entries) == (0, False, 2.0)
    assert catalog_rank("unknown", entries) == (0, False, 2.0)
    p.write_text("models:\n  - {name: a, path: /m/a, priority: high}\n")
    with pytest.raises(ConfigError, match="priority must be an integer"):
        load_catalog(p)
    assert ModelEntry("x", "/m").priority == 0


def test_the_give_way_order_is_one_setting() -> None:
    assert str(parse_give_way("")) == "prefetched_kv,idle_weights,active_weights"
    assert parse_give_way("prefetch_first") == GiveWay()
    weights = parse_give_way("weights_first")
    assert not weights.prefetch_first and weights.idle_first
    with pytest.raises(ConfigError, match="engine.remap.give_way"):
        parse_give_way("idle_weights,prefetched_kv")


class FakeNode:
    """Two engines: ``busy`` waits for KV during a burst; ``idle`` can lend 3 layers.
    The store has inactive tensors to release once."""

    def __init__(self) -> None:
        self.burst = True
        self.lent = {"busy": 0, "idle": 0}
        self.calls: list[tuple[str, int]] = []
        self.store_bytes = 1 << 20
        self.shrunk: list[str] = []

    async def poll(self) -> list[EngineMemory]:
        running = 4 if self.burst else 0
        busy = Lender("busy", running, 3 if self.burst else 0, 3 - self.lent["busy"],
                      self.lent["busy"], priority=5)
        idle = Lender("idle", 0, 0, 3 - self.lent["idle"], self.lent["idle"])
        return [EngineMemory("busy", running, busy.waiting, 10, busy, ""),
                EngineMemory("idle", 0, 0, 0, idle, "")]

    async def shrink(self, name: str, pages: int) -> int:
        self.shrunk.append(name)
        return 0  # no pages to take back

    async def lend(self, name: str, layers: int) -> int:
        self.calls.append((name, layers))
        self.lent[name] = max(0, min(3, self.lent[name] + layers))
        return self.lent[name]

    def release(self) -> int:
        got, self.store_bytes = self.store_bytes, 0
        return got


async def test_a_burst_makes_idle_engines_lend_and_they_take_it_back_after() -> None:
    node = FakeNode()
    broker = MemoryBroker(node.poll, node.shrink, release_weights=node.release,
                          lend=node.lend, revert_after_s=0.0)
    await broker.balance()  # first the Reuse Store's inactive tensors (idle weights)
    assert broker.released_weight_bytes == 1 << 20 and node.calls == []
    for _ in range(5):  # then the idle engine's layers, one a round, up to its cap
        await broker.balance()
    assert node.calls == [("idle", 1)] * 3 and node.lent == {"busy": 0, "idle": 3}
    assert broker.layers_lent == 3
    assert node.shrunk == []  # (nobody but the waiting engine held pages)
    node.burst = False  # the burst is over: nothing is left lent
    await broker.balance()
    assert node.shrunk == ["busy"]  # its cached KV gives way before the lent weights
    assert node.lent == {"busy": 0, "idle": 0} and node.calls[-1] == ("idle", -3)
    assert broker.layers_taken_back == 3
    await broker.balance()
    assert len(node.calls) == 4  # nothing lent, nothing to take back


async def test_no_lending_without_the_setting() -> None:
    node = FakeNode()
    broker = MemoryBroker(node.poll, node.shrink, lend=None)
    for _ in range(3):
        await broker.balance()
    assert node.calls == []


class FakeEngine:
    def __init__(self) -> None:
        self.prefetches = 0

    async def Prefetch(self, request: object, timeout: float) -> engine_pb2.PrefetchReply:
        self.prefetches += 1
        return engine_pb2.PrefetchReply(blocks=1)


@pytest.mark.parametrize(("give_way", "alpha", "fills"), [
    ("", 0, True), ("", 1, False), ("weights_first", 1, True)])
async def test_the_prefetcher_holds_device_fills_while_weights_are_lent(
        give_way: str, alpha: int, fills: bool) -> None:
    remaps = [engine_pb2.RemapCounters(alpha=alpha, give_way=give_way)]
    eng = FakeEngine()
    pre = AdvisoryPrefetcher("", 1.0, engines=lambda model: eng,  # type: ignore[arg-type,return-value]
                             weights_lent=lambda: weights_lent(remaps))
    await pre._fill_device(Advice("adv", "t", "s", ""))
    assert eng.prefetches == (1 if fills else 0)
    held = pre.metrics.prefetch_hops.labels("device", "held")._value.get()
    assert held == (0 if fills else 1)
