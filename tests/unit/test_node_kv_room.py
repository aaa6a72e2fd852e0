"""The node's view of its engines' KV memory, and the deadline queue dispatching only what
fits (Prism §6.3: no queuing inside the engines). Real device ledgers (files), no engines."""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.nodemgr.admission import DeadlineAdmission
from services.nodemgr.kv_room import EngineKV, KVRoom
from services.nodemgr.memory_broker import EngineMemory
from shared.device_ledger import DeviceLedger, create_ledger
from shared.proto import common_pb2, engine_pb2

KIB = 1 << 10


def engine(label: str, spare_kib: int, kv_kib: int = 1024) -> EngineKV:
    """16 tokens a block of 1 KiB."""
    return EngineKV(label, KIB, 16, spare_kib * KIB, kv_kib * KIB)


def ledgers(tmp_path: Path, budget_kib: int) -> tuple[DeviceLedger, DeviceLedger]:
    """The node's ledger: the nodemgr's view and another engine's."""
    path = create_ledger(tmp_path / "node.ledger", budget_kib * KIB)
    return DeviceLedger(path), DeviceLedger(path)


def test_an_engines_room_is_its_spare_memory_then_what_the_ledger_lets_it_take(
        tmp_path: Path) -> None:
    path = create_ledger(tmp_path / "node.ledger", 100 * KIB)
    led, a, b = DeviceLedger(path), DeviceLedger(path), DeviceLedger(path)
    a.join("a")
    assert a.take(10 * KIB)  # A's KV: spare pages (free or prefix cache)
    b.join("b")
    assert b.take(40 * KIB)  # B's: running
    b.reserve(30 * KIB)  # (filled: it holds nothing back)
    room = KVRoom(led)
    room.update({"A": engine("a", 10), "B": engine("b", 0)}, asked_at=0.0)
    assert room.need_bytes("A", 33) == 3 * KIB  # (3 blocks of 16 tokens)
    plan = room.plan()
    assert plan.fits("A", 60 * KIB) and not plan.fits("A", 61 * KIB)  # 10 spare + 50 free
    assert plan.fits("B", 50 * KIB) and not plan.fits("B", 51 * KIB)
    assert plan.fits("A", 71 * KIB)  # more than it could ever hold (100 - B's reserve of
    # 30): not held back, its engine decides what to do with it
    plan.take("A", 40 * KIB)  # 10 from its spare, 30 from the ledger
    assert plan.fits("A", 20 * KIB) and not plan.fits("A", 21 * KIB)
    assert plan.fits("B", 20 * KIB) and not plan.fits("B", 21 * KIB)
    plan.close()  # (a request did not fit: the ledger's bytes are its)
    assert not plan.fits("B", 1 * KIB) and not plan.fits("A", 1 * KIB)
    assert room.plan().fits("A", 60 * KIB)  # (a plan is one round's: nothing was promised)
    b.give(40 * KIB)  # B idle: its unfilled reserve holds 30 back from A, not from B
    plan = room.plan()
    assert plan.fits("A", 70 * KIB)  # 10 spare + 90 free - 30
    assert plan.fits("B", 90 * KIB) and not plan.fits("B", 91 * KIB)
    for x in (a, b, led):
        x.close()


def test_a_dispatched_request_counts_until_a_status_after_its_first_token(
        tmp_path: Path) -> None:
    led, a = ledgers(tmp_path, 20)
    a.join("a")
    assert a.take(20 * KIB)  # all of it, A's spare pages
    now = [0.0]
    room = KVRoom(led, clock=lambda: now[0])
    room.update({"A": engine("a", 20)}, asked_at=0.0)
    room.promise("r1", "A", 15 * KIB)
    assert not room.plan().fits("A", 10 * KIB)  # 5 of the 20 spare left
    now[0] = 2.0
    room.started("r1")  # its KV is allocated now
    room.update({"A": engine("a", 20)}, asked_at=1.0)  # (asked before: not in it)
    assert not room.plan().fits("A", 10 * KIB)
    room.update({"A": engine("a", 5)}, asked_at=3.0)  # shows it
    assert room.plan().fits("A", 5 * KIB) and not room.plan().fits("A", 6 * KIB)
    room.promise("r2", "A", 5 * KIB)
    room.forget("r2")  # (ended before its first token)
    assert room.plan().fits("A", 5 * KIB)
    a.close()
    led.close()


async def test_the_queue_dispatches_only_what_fits_and_in_its_order(tmp_path: Path) -> None:
    """A request whose KV does not fit waits in the node's queue, not in its engine; a later
    one cannot take the ledger's free bytes from it, only its own engine's spare memory;
    when memory frees up it goes first."""
    led, holder = ledgers(tmp_path, 100)
    holder.join("c")
    assert holder.take(90 * KIB)  # another engine's KV: 10 KiB of the ledger are free
    room = KVRoom(led)
    room.update({"A": engine("a", 0), "B": engine("b", 4)}, asked_at=0.0)
    now = [0.0]
    wakes = [0]  # the broker woken: when a request is newly held, and when one ends

    def wake() -> None:
        wakes[0] += 1

    adm = DeadlineAdmission(depth=4, default_speed=1e6, slo={"a": 1.0, "b": 5.0}.__getitem__,
                            clock=lambda: now[0], room=room, growth_tokens=0, on_blocked=wake)
    order: list[str] = []
    ends: dict[str, asyncio.Event] = {}

    async def request(name: str, model: str, eng: str, tokens: int) -> None:
        ends[name] = asyncio.Event()
        async with adm.slot(model, eng, tokens) as first_token:
            order.append(name)
            first_token(tokens)
            await ends[name].wait()

    big = asyncio.create_task(request("big", "a", "A", 20 * 16))  # 20 KiB: does not fit
    await asyncio.sleep(0)
    small = asyncio.create_task(request("small", "b", "B", 8 * 16))  # 8: the ledger's 10 KiB
    tiny = asyncio.create_task(request("tiny", "b", "B", 3 * 16))  # 3: B's own spare 4
    await asyncio.sleep(0.01)
    assert order == ["tiny"] and adm.blocked == {"A": 1, "B": 1}
    assert wakes == [1]  # (held since the first pump: once, not at every pump)
    ends["tiny"].set()
    await asyncio.sleep(0.01)
    assert wakes == [2]  # (its memory may be what they wait for)
    holder.give(60 * KIB)  # that engine's requests ended: 70 KiB free
    adm.pump()
    await asyncio.sleep(0.01)
    assert order == ["tiny", "big", "small"] and adm.blocked == {}
    for e in ends.values():
        e.set()
    await asyncio.gather(big, small, tiny)
    assert wakes == [2]
    holder.close()
    led.close()


async def test_the_broker_reclaims_for_requests_the_queue_holds(tmp_path: Path) -> None:
    """A request held in the node's queue for want of memory counts as waiting in its
    engine: the memory broker then takes the pages idle engines keep (or nothing would
    ever free them), and the statuses it polls let the queue dispatch what now fits."""
    from services.nodemgr.app import _engine_memory
    from services.nodemgr.memory_broker import to_reclaim

    def status(name: str, committed: int, used: int) -> engine_pb2.EngineStatus:
        return engine_pb2.EngineStatus(
            models=[common_pb2.ModelInfo(name=name, block_size=16)], blocks_total=1024,
            blocks_used=used, blocks_committed=committed, block_bytes=KIB)

    class Link:
        def __init__(self, address: str, st: engine_pb2.EngineStatus) -> None:
            self.address, self.st = address, st

        async def raw_status(self) -> engine_pb2.EngineStatus:
            return self.st

    class Engines:
        def __init__(self) -> None:
            self.links = [Link("A", status("a", 0, 0)), Link("I", status("i", 100, 0))]

    led, idle = ledgers(tmp_path, 64)
    idle.join("i")
    assert idle.take(64 * KIB)  # all of it, committed by the idle engine I
    room = KVRoom(led)
    adm = DeadlineAdmission(depth=4, room=room, growth_tokens=0)
    memory = await _engine_memory(Engines(), adm)  # type: ignore[arg-type]
    assert to_reclaim(memory) == []
    waiting = asyncio.create_task(_enter(adm.slot("a", "A", 10 * 16)))
    await asyncio.sleep(0.01)
    assert not waiting.done() and adm.blocked == {"A": 1}
    memory = await _engine_memory(Engines(), adm)  # type: ignore[arg-type]
    assert [m.waiting for m in memory] == [1, 0] and to_reclaim(memory) == ["I"]
    idle.give(64 * KIB)  # (what ShrinkKV on I does)
    await _engine_memory(Engines(), adm)  # type: ignore[arg-type]
    await asyncio.wait_for(waiting, 1.0)
    assert adm.blocked == {}
    idle.close()
    led.close()


async def _enter(slot: object) -> None:
    async with slot as first_token:  # type: ignore[attr-defined]
        first_token(160)


def test_what_could_never_fit_is_not_held_back(tmp_path: Path) -> None:
    """The queue must not wait for good: a request needing more than an engine could ever
    hold (the budget less every model's weights and the others' reserves) is let through
    to its engine, as is one for an engine whose status did not come."""
    led, other = ledgers(tmp_path, 100)
    other.join("b")
    assert other.take(40 * KIB, weights=True)
    other.reserve(20 * KIB)
    assert other.take(30 * KIB)  # B's running KV: 30 KiB free
    room = KVRoom(led)
    room.update({"A": engine("a", 0), "B": engine("b", 0)}, asked_at=0.0)
    plan = room.plan()
    assert not plan.fits("A", 40 * KIB)  # fits once B's requests end
    assert plan.fits("A", 41 * KIB)  # 100 - 40 of weights - 20 of B's reserve: never
    room.promise("r", "B", 10 * KIB)
    room.update({"A": engine("a", 0)}, asked_at=1.0)  # B did not answer
    assert room.plan().fits("B", 30 * KIB)
    other.close()
    led.close()


async def test_a_request_waiting_for_memory_wakes_the_broker() -> None:
    """The broker looks every ``interval_s``; a request held for memory wakes it at once
    (after a fifth of that), so that it reclaims without a whole interval's wait."""
    from services.nodemgr.memory_broker import MemoryBroker

    rounds: list[float] = []
    loop = asyncio.get_running_loop()

    async def poll() -> list[EngineMemory]:
        rounds.append(loop.time())
        return []

    async def shrink(name: str, pages: int) -> int:
        return 0

    broker = MemoryBroker(poll, shrink, interval_s=5.0)
    task = asyncio.create_task(broker.run())
    await asyncio.sleep(0.05)
    broker.wake()
    await asyncio.sleep(2.0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert len(rounds) == 2 and 0.9 < rounds[1] - rounds[0] < 1.5
