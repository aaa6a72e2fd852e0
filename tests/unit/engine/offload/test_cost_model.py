"""Load or recompute: the planner's choice for given bandwidths and compute rates."""

from __future__ import annotations

from services.engine.offload.cost_model import (
    LAYERWISE,
    RECOMPUTE,
    WHOLE_PREFIX,
    PrefillRate,
    choose_spans,
)
from services.engine.reuse_plan import ReusePlan
from shared.kv_layout import KVSpan

BS = 16
MB = 1_000_000


def spans(*tiers: str, blocks: int = 4, first: int = 0, nbytes: int = 4 * MB) -> list[KVSpan]:
    out = []
    for i, t in enumerate(tiers):
        out.append(KVSpan(bytes([i + 1]), first + i * blocks, blocks, t, nbytes))
    return out


def choose(ss: list[KVSpan], bw: dict[str, float], spt: float, mode: str = LAYERWISE,
           prompt: int = 200, device: int = 0) -> int:
    return choose_spans(ss, prompt_tokens=prompt, device_tokens=device, block_size=BS,
                        tier_bytes_per_s=bw, seconds_per_token=spt, num_layers=4,
                        mode=mode).spans


def test_fast_tier_loads_everything() -> None:
    # 3 spans x 64 tokens: recompute 192 tokens x 10 ms = 1.9 s; load 12 MB at 5 GB/s = 2.4 ms
    assert choose(spans("dram", "dram", "dram"), {"dram": 5e9}, 0.01) == 3


def test_slow_tier_never_beats_recompute() -> None:
    # 4 MB per span at 1 MB/s = 4 s per span vs 64 tokens x 1 ms = 64 ms to recompute
    assert choose(spans("s3", "s3"), {"s3": 1 * MB}, 0.001) == 0


def test_keeps_the_longest_prefix_worth_loading() -> None:
    # dram spans are cheap; the third span sits on a slow disk
    ss = spans("dram", "dram", "ssd")
    assert choose(ss, {"dram": 5e9, "ssd": 0.5 * MB}, 0.001) == 2


def test_unknown_tier_bandwidth_stops_the_prefix() -> None:
    assert choose(spans("dram", "tape", "dram"), {"dram": 5e9}, 0.01) == 1


def test_layerwise_hides_load_behind_compute_whole_prefix_does_not() -> None:
    # load 1 s vs recompute of the span 0.64 s; the suffix (136 tokens) takes 1.36 s:
    # overlapped the load hides behind it (~1.6 s < 2.0 s recompute), serial it does not.
    ss = spans("ssd", nbytes=MB)
    bw = {"ssd": 1 * MB}
    assert choose(ss, bw, 0.01, LAYERWISE) == 1
    assert choose(ss, bw, 0.01, WHOLE_PREFIX) == 0


def test_recompute_mode_and_no_spans_load_nothing() -> None:
    assert choose(spans("dram"), {"dram": 5e9}, 0.01, RECOMPUTE) == 0
    assert choose([], {"dram": 5e9}, 0.01) == 0


def test_plan_trimmed_by_a_larger_device_hit() -> None:
    ss = tuple(spans("dram", "ssd", first=2, nbytes=4000))  # blocks [2,6) and [6,10)
    plan = ReusePlan(ss, "lease", 2, 10)
    t = plan.trimmed(3)
    assert t is not None and (t.first_block, t.end_block) == (3, 10)
    got = [(s.first_block, s.use_blocks, s.nbytes) for s in t.spans]
    assert got == [(3, 3, 3000), (6, 4, 4000)]
    t7 = plan.trimmed(7)
    assert [(s.first_block, s.use_blocks, s.tier) for s in t7.spans] == [(7, 3, "ssd")]
    assert plan.trimmed(10) is None  # all of it on device now
    assert plan.trimmed(1) is None  # the device lost a block the plan relied on: a gap


def test_prefill_rate_ewma_ignores_small_steps() -> None:
    r = PrefillRate(1e-3, alpha=0.5, min_tokens=32)
    r.observe(1, 0.5)  # a decode step: not prefill-dominated
    assert r.value == 1e-3
    r.observe(100, 0.2)
    assert r.value == 0.002
    r.observe(100, 0.4)
    assert abs(r.value - 0.003) < 1e-12
