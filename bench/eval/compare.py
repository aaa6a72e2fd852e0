"""The evaluation's comparisons, from the records alone: each variant's repetitions as
means with 95% intervals, variants compared pair by pair (repetition r of A against
repetition r of B: the same trace and seed, replayed back to back) and the goals of issue
#42 judged on those intervals (``stats.py``): a goal is met only when its whole interval
is on the right side, and a difference is called only when the paired interval excludes
no change."""

from __future__ import annotations

from typing import Any

from bench.eval.profiles import Profile
from bench.eval.stats import Interval, goal_at_least, goal_at_most, mean_interval, paired_ratio

Record = dict[str, Any]
NORM = "normalized_latency_s"


def same(r: Record, variant: str, users: int, missed: float = 0.0,
         spurious: float = 0.0) -> bool:
    return (r["variant"], r["users"], r["missed"], r["spurious"]) == (
        variant, users, missed, spurious)


def reps(records: list[Record], variant: str, users: int, missed: float = 0.0,
         spurious: float = 0.0) -> dict[int, Record]:
    """The repetitions of one replay configuration, by repetition number (records of a run
    before repetitions existed count as repetition 0)."""
    return {int(r.get("rep", 0)): r for r in records
            if same(r, variant, users, missed, spurious)}


def value(r: Record, key: str) -> float | None:
    """A summary value, or the record's own (``imbalance``); None when not measured."""
    v = r["imbalance"] if key == "imbalance" else r["summary"].get(key)
    return float(v) if v is not None else None


def interval(runs: dict[int, Record], key: str) -> Interval | None:
    xs = [v for r in runs.values() if (v := value(r, key)) is not None]
    return mean_interval(xs) if xs else None


def paired(a: dict[int, Record], b: dict[int, Record], key: str
           ) -> tuple[list[float], list[float]]:
    """The values of ``key`` in the repetitions both ran (in repetition order)."""
    xs, ys = [], []
    for rep in sorted(set(a) & set(b)):
        x, y = value(a[rep], key), value(b[rep], key)
        if x is not None and y is not None and y != 0:
            xs.append(x)
            ys.append(y)
    return xs, ys


def ratio(a: dict[int, Record], b: dict[int, Record], key: str = NORM) -> Interval | None:
    """How many times a's ``key`` is b's, paired by repetition, with its interval."""
    xs, ys = paired(a, b, key)
    return paired_ratio(xs, ys) if xs else None


def difference_word(r: Interval | None) -> str:
    """For a paired ratio a/b: "a higher", "a lower" or "no difference" (the interval
    contains 1)."""
    if r is None:
        return "not measured"
    if r.low > 1.0:
        return "higher"
    if r.high < 1.0:
        return "lower"
    return "no difference"


def _line(text: str, iv: Interval | None, verdict: str, shown: str) -> str:
    return f"| {text} | {shown if iv is not None else '–'} | " \
           f"{verdict if iv is not None else 'not measured'} |"


def goals(profile: Profile, records: list[Record]) -> list[str]:
    """Issue #42's goals at the profile's highest load, each from paired repetitions."""
    hi = profile.high_load
    bal = reps(records, "balanced", hi)
    lines = ["| goal (at the highest load; 95% interval over paired repetitions) | "
             "measured | verdict |", "| --- | --- | --- |"]
    for name, goal in (("recompute", 2.4), ("sticky", 1.6), ("prefix", 1.5)):
        r = ratio(reps(records, name, hi), bal)
        lines.append(_line(f"Overture vs {name}: ≥ {goal}× lower mean normalized latency",
                           r, goal_at_least(r, goal) if r else "", r.fmt(1, 2, "×") if r
                           else ""))
    b, s = interval(bal, "imbalance"), interval(reps(records, "sticky", hi), "imbalance")
    if b is not None and s is not None:
        ok = b.high <= 1.2 and s.low >= 2.5
        lines.append(_line("max/median node load ≤ 1.2 for Overture, sticky ≥ 2.5", b,
                           "met" if ok else "**missed**",
                           f"Overture {b.fmt(1, 2)}, sticky {s.fmt(1, 2)}"))
    cost = _cost(reps(records, "balanced", hi, missed=0.1), bal)
    lines.append(_line("10% missed advisories cost ≤ 6% latency (and shown outside the "
                       "noise)", cost, _cost_verdict(cost, 0.06),
                       cost.fmt(100, 1, "%") if cost else ""))
    # Throughput per token served (1 / normalized latency): a replay's requests/s is set
    # by its users' reading and typing, and abandoned drafts lengthen their sessions.
    cost = _cost(reps(records, "balanced", hi, spurious=0.6), bal)
    lines.append(_line("60% spurious advisories cost ≤ 2.1% throughput (tokens per second "
                       "of latency; shown outside the noise)", cost,
                       _cost_verdict(cost, 0.021), cost.fmt(100, 1, "%") if cost else ""))
    return lines


def _cost(variant: dict[int, Record], base: dict[int, Record]) -> Interval | None:
    """The relative latency cost of ``variant`` over ``base``: paired ratio − 1."""
    r = ratio(variant, base)
    return None if r is None else Interval(r.mean - 1, r.low - 1, r.high - 1, r.n)


def _cost_verdict(cost: Interval | None, goal: float) -> str:
    if cost is None:
        return ""
    verdict = goal_at_most(cost, goal)
    if cost.low <= 0.0 <= cost.high:
        return f"{verdict}; no difference from 0% (inside the noise)"
    return verdict


def sweep_rows(records: list[Record], hi: int, field: str, values: tuple[float, ...]
               ) -> list[str]:
    """Rows of a missed or spurious sweep: each point's normalized latency with its
    interval and its paired cost against 0% on the same traces."""
    base = reps(records, "balanced", hi)
    out = ["| " + field + " | runs | normalized latency ms/token | cost vs 0% (paired) | "
           "difference |", "| --- | --- | --- | --- | --- |"]
    for x in (0.0, *values):
        runs = reps(records, "balanced", hi, **{field: x})
        iv = interval(runs, NORM)
        if iv is None:
            continue
        if x == 0.0:
            out.append(f"| 0% | {iv.n} | {iv.fmt(1000, 1)} | – | – |")
            continue
        cost = _cost(runs, base)
        word = difference_word(ratio(runs, base))
        out.append(f"| {x:.0%} | {iv.n} | {iv.fmt(1000, 1)} | "
                   f"{cost.fmt(100, 1, '%') if cost else '–'} | {word} |")
    return out
