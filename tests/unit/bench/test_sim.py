"""The cluster simulator on small hand-made traces: recomputing costs more as history
grows, sticky placement piles load on a node, a missed advisory costs time to first token,
prefetched blocks only give way to requests under cooperative memory, and calibrations
round-trip through JSON."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench.sim.cluster import simulate
from bench.sim.costs import Calibration
from bench.sim.scale import imbalance
from bench.workloads.trace import Session, Trace, Turn

HERE = Path(__file__).resolve().parents[3] / "bench" / "sim"


def cal(**kw: object) -> Calibration:
    base = Calibration(
        name="test", source="test", prefill_base_s=0.001, prefill_s_per_token=1e-4,
        prefill_s_per_token_ctx=0.0, decode_base_s=0.01, decode_s_per_seq=0.001,
        decode_s_per_ctx_token=0.0, kv_bytes_per_token=1000, num_layers=4,
        device_kv_bytes=16000 * 1000, dram_bytes=1 << 40, dram_bytes_per_s=1e9,
        peer_bytes_per_s=1e9, s3_bytes_per_s=1e8, load_overhead_s=0.001,
        max_num_seqs=64, max_batched_tokens=512, block_tokens=16, layer_groups=1)
    return dataclasses.replace(base, **kw)


def turn(at: float, user: int, answer: int, advised: bool = True, lead: float = 5.0) -> Turn:
    return Turn(at - lead if advised else None, at, user, answer, "x")


def session(sid: str, *turns: Turn) -> Session:
    return Session(sid, 0, 0, tuple(turns))


def ttfts(trace: Trace, **kw: object) -> dict[tuple[str, int], float]:
    out = simulate(trace, **kw)  # type: ignore[arg-type]
    assert all(not r.error for r in out.results)
    return {(r.session_id, r.turn): r.ttft_s for r in out.results}


def test_recompute_ttft_grows_with_history_and_balanced_does_not() -> None:
    s = session("s", *(turn(100.0 * i + 10, 200, 200) for i in range(6)))
    kw = {"nodes": 2, "calibration": cal()}
    rec = ttfts(Trace([s]), policy="recompute", **kw)
    bal = ttfts(Trace([s]), policy="balanced", **kw)
    assert rec[("s", 5)] > 5 * rec[("s", 0)]  # 2200 tokens of history recomputed
    assert bal[("s", 5)] < 1.5 * bal[("s", 0)]
    assert bal[("s", 5)] < rec[("s", 5)] / 4


def test_sticky_piles_load_on_a_node_and_balanced_spreads_it() -> None:
    # 16 sessions start together (spread one per node in turn); the sessions that land
    # on node00 have long answers in every later turn, the others short ones.
    sessions = []
    for k in range(16):
        answer = 300 if k % 4 == 0 else 5
        turns = [turn(0.0, 20, 1, advised=False)]
        turns += [turn(3.0 * i, 20, answer) for i in range(1, 8)]
        sessions.append(session(f"s{k:02d}", *turns))
    kw = {"nodes": 4, "calibration": cal()}
    sticky = simulate(Trace(sessions), policy="sticky", **kw)
    balanced = simulate(Trace(sessions), policy="balanced", **kw)
    heavy = {r.node for r in sticky.results if r.session_id in ("s00", "s04", "s08", "s12")}
    assert heavy == {"node00"}
    assert imbalance(sticky.load)["mean"] > 2.0
    assert imbalance(balanced.load)["mean"] < imbalance(sticky.load)["mean"] / 1.5


def _evicted_then_resumed(advised: bool) -> float:
    """Session a's KV is pushed out of the device by b, then a comes back."""
    a = session("a", turn(0.0, 1500, 20, advised=False), turn(50.0, 20, 20, advised, 20.0))
    b = session("b", turn(10.0, 2000, 20, advised=False))
    # 1.5 MB of KV: 0.75 s to load, 1.5 s to recompute
    slow = cal(device_kv_bytes=2200 * 1000, dram_bytes_per_s=2e6, prefill_s_per_token=1e-3)
    return ttfts(Trace([a, b]), policy="balanced", nodes=1, calibration=slow)[("a", 1)]


def test_a_missed_advisory_costs_time_to_first_token() -> None:
    advised, missed = _evicted_then_resumed(True), _evicted_then_resumed(False)
    assert missed > 0.7  # loads 1.5k tokens from DRAM on the critical path
    assert advised < 0.3  # prefetched while the user typed
    assert missed > 5 * advised


def _prefetch_holds_memory(cooperative: bool, purge_order: str = "layers") -> float:
    """a and b are advised (their KV prefetched) long before their requests; c needs
    memory meanwhile."""
    sessions = [session(sid, turn(0.0, 1000, 280, advised=False),
                        turn(100.0, 10, 10, True, lead=90.0)) for sid in ("a", "b")]
    sessions.append(session("e", turn(3.0, 2800, 200, advised=False)))
    sessions.append(session("c", turn(15.0, 2000, 100, advised=False)))
    small = cal(device_kv_bytes=200 * 16 * 1000)  # 200 blocks
    out = ttfts(Trace(sessions), policy="balanced", nodes=1, calibration=small,
                cooperative=cooperative, purge_order=purge_order)
    return out[("c", 0)]


def test_prefetched_blocks_give_way_only_under_cooperative_memory() -> None:
    assert _prefetch_holds_memory(True) < 1.0
    assert _prefetch_holds_memory(True, "sessions") < 1.0
    # Without it c waits for the advisories to lapse (30 s after they were given).
    assert _prefetch_holds_memory(False) > 10.0


def test_layerwise_loading_overlaps_compute() -> None:
    a = session("a", turn(0.0, 1500, 20, advised=False), turn(50.0, 500, 20, advised=False))
    b = session("b", turn(10.0, 2000, 20, advised=False))
    slow = cal(device_kv_bytes=2200 * 1000, dram_bytes_per_s=3e6, prefill_s_per_token=1e-3)
    kw = {"policy": "balanced", "nodes": 1, "calibration": slow}
    overlap = ttfts(Trace([a, b]), layerwise=True, **kw)[("a", 1)]
    serial = ttfts(Trace([a, b]), layerwise=False, **kw)[("a", 1)]
    assert serial > overlap + 0.3  # 0.5 s of load and 0.5 s of compute: max vs sum


def test_calibrations_round_trip_and_the_shipped_ones_load(tmp_path: Path) -> None:
    c = cal(name="x")
    c.save(tmp_path / "c.json")
    assert Calibration.load(tmp_path / "c.json") == c
    (tmp_path / "bad.json").write_text('{"name": "x", "warp_speed": 9}')
    with pytest.raises(ValueError, match="warp_speed"):
        Calibration.load(tmp_path / "bad.json")
    for f in ("calibration-cpu-small.json", "calibration-a100-llama8b.json"):
        loaded = Calibration.load(HERE / f)
        assert loaded.step_s([(100, 0)], 0, 0) > 0 and loaded.device_blocks > 1
