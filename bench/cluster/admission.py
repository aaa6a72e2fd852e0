"""Admission that keeps its promise: the queue wait of admitted requests against the
engines' limit (``engine.max_queue_delay_s``) at 1×, 2× and 10× capacity, and the
throughput kept there.

    python -m bench.cluster.admission [--loads 1,2,10] [--reps 2] [--duration 20]
        [--limit 0.5] [--size small] [--max-tokens 16] [--raw] [--no-window]

A real cluster as a user starts it (``overture up --nodes 2 --no-s3``, the demo model of
``--size``, fp32, each node on its own core) with ``engine.max_queue_delay_s`` set to
``--limit``; streamed ``/v1/chat/completions`` from one aiohttp client in this process
(``chat_client``: a prompt that differs per request, ``ignore_eos``, temperature 0).
Capacity is measured first (closed loop), then Poisson arrivals at each multiple of it for
``--duration`` s; the levels are run ``--reps`` times, their order rotated each time
(1×, 2×, 10×; then 2×, 10×, 1×; ...), so that a drift of the shared machine falls on
every level alike.

Per level: the admitted requests' (200s) queue wait p50 / p99, as their time to first
token seen by the client: the engine's queue wait plus the prefill of a short prompt, the
scheduler's and the node's hops and the stream's first write (an upper bound on the wait
itself: with the demo models the rest is a few milliseconds); the throughput (200s per
second) and its ratio to the same rep's 1×; the share of 429s (every one with
``Retry-After``). Beside the client's view, the scheduler's: its
``overture_time_to_first_token_seconds`` histogram (from the request's arrival in the
scheduler's handler to its first token leaving) read from ``/metrics`` before and after
the level, p50 / p99 interpolated within its buckets; the difference between the two is
time the request spent in neither the scheduler's handler nor the engines (the client's
and the scheduler's event loops, the connections). The median over reps is reported with
its range, and the machine's load average while the level ran (the machine may be shared).

Goals (issue 43): admitted p99 ≤ 2 × the limit at 10×; throughput at 10× ≥ 0.9× of 1×.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from bench.cluster.chat_client import Client, Result
from bench.cluster.overload import log_line, measure_capacity, open_loop, pct
from bench.harness import overture_up, show_progress


def level_stats(results: list[Result], duration: float) -> dict[str, Any]:
    """One level's numbers: admitted waits, throughput, shares."""
    ok = [r for r in results if r.outcome == "200"]
    waits = [r.ttft for r in ok if r.ttft is not None]
    refused = [r for r in results if r.outcome == "429"]
    return {
        "sent": len(results), "ok": len(ok), "throughput_rps": len(ok) / duration,
        "wait_p50_s": pct(waits, 0.5), "wait_p99_s": pct(waits, 0.99),
        "share_429": len(refused) / len(results) if results else 0.0,
        "retry_after_429": sum(1 for r in refused if r.retry_after is not None),
        "failed": len(results) - len(ok) - len(refused),
    }


TTFT_METRIC = "overture_time_to_first_token_seconds_bucket"
STAGE_METRIC = "overture_first_token_stage_seconds_bucket"
STAGES = ("scheduler", "to_engine", "engine", "back")
WINDOW_METRIC = 'overture_admission_refusals_total{reason="window_full"}'


async def ttft_buckets(url: str) -> dict[str, dict[float, float]]:
    """The scheduler's TTFT histogram, all models ("ttft"), and its split by stage (each
    of ``STAGES``: where the time went): cumulative count per upper bound."""
    out: dict[str, dict[float, float]] = {"ttft": {}, **{s: {} for s in STAGES},
                                          "window_full": {0.0: 0.0}}
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(WINDOW_METRIC + " "):  # (429s of the scheduler's windows)
            out["window_full"][0.0] = float(line.rpartition(" ")[2])
            continue
        if line.startswith(TTFT_METRIC + "{"):
            key = "ttft"
        elif line.startswith(STAGE_METRIC + "{"):
            key = line.split('stage="', 1)[1].split('"', 1)[0]
            if key not in out:
                continue
        else:
            continue
        labels, _, value = line.rpartition(" ")
        le = labels.split('le="', 1)[1].split('"', 1)[0]
        bound = float("inf") if le == "+Inf" else float(le)
        out[key][bound] = out[key].get(bound, 0.0) + float(value)
    return out


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float
                    ) -> float | None:
    """The ``q`` quantile of what was observed between two reads of a histogram, linearly
    interpolated within its bucket (None: nothing observed, or past the last bound)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    rank, lo, below = q * total, 0.0, 0.0
    for bound, cum in zip(bounds, counts, strict=True):
        if cum >= rank:
            if bound == float("inf"):
                return None
            inside = cum - below
            return lo + (bound - lo) * ((rank - below) / inside if inside else 1.0)
        lo, below = bound, cum
    return None


class LoopLag:
    """How late this process's event loop wakes up (the load generator's own lag, which
    its times to first token include): sampled every ``period_s`` while running."""

    def __init__(self, period_s: float = 0.01) -> None:
        self.period_s = period_s
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.period_s)
            self.lags.append(max(0.0, loop.time() - t - self.period_s))

    def __enter__(self) -> LoopLag:
        self._task = asyncio.get_running_loop().create_task(self._sample())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()


def rotations(loads: list[float], reps: int) -> list[list[float]]:
    """The level order of each rep: ``loads`` rotated by one each time."""
    return [loads[i % len(loads):] + loads[:i % len(loads)] for i in range(reps)]


def _loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


async def run_levels(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    async with Client(url, model, rng) as client:
        log_line(f"capacity: {args.capacity_clients} clients ...")
        cap = await measure_capacity(client, args.capacity_clients, args.warmup,
                                     args.capacity_duration, args.max_tokens,
                                     args.request_timeout)
        rate = cap["capacity_rps"]
        log_line(f"capacity {rate:.2f} req/s")
        runs: list[dict[str, Any]] = []
        if rate <= 0:
            return {"capacity": cap, "runs": runs}
        for rep, order in enumerate(rotations(args.loads, args.reps)):
            for mult in order:
                await asyncio.sleep(args.pause)
                before, hist = _loadavg(), await ttft_buckets(url)
                with LoopLag() as lag:
                    level = await open_loop(client, f"{mult:g}×", mult * rate,
                                            args.duration, args.max_tokens,
                                            args.request_timeout, rng)
                s = level_stats(level.results, args.duration)
                after = await ttft_buckets(url)
                s.update(rep=rep, multiple=mult, loadavg=(before + _loadavg()) / 2,
                         server_p50_s=bucket_quantile(hist["ttft"], after["ttft"], 0.5),
                         server_p99_s=bucket_quantile(hist["ttft"], after["ttft"], 0.99))
                for stage in STAGES:
                    s[f"{stage}_p99_s"] = bucket_quantile(hist[stage], after[stage], 0.99)
                s["client_p99_s"] = pct(lag.lags, 0.99)
                refused = round(s["share_429"] * s["sent"])
                s["window_429"] = ((after["window_full"][0.0] - hist["window_full"][0.0])
                                   / refused if refused else None)
                runs.append(s)
                log_line(f"rep {rep} {mult:g}×: {s['ok']}/{s['sent']} admitted, p99 wait "
                     f"{_ms(s['wait_p99_s'])} (scheduler {_ms(s['server_p99_s'])}), "
                     f"load {s['loadavg']:.1f}")
    return {"capacity": cap, "runs": runs}


def summarize(res: dict[str, Any], loads: list[float]) -> list[dict[str, Any]]:
    """Per level: the median over reps (and range) of each number; throughput against
    the same rep's 1×."""
    runs = res["runs"]
    base = {r["rep"]: r["throughput_rps"] for r in runs if r["multiple"] == 1}
    rows = []
    for mult in loads:
        mine = [r for r in runs if r["multiple"] == mult]
        if not mine:
            continue
        vs = [r["throughput_rps"] / base[r["rep"]] for r in mine if base.get(r["rep"])]

        def med(key: str, rs: list[dict[str, Any]] = mine) -> tuple[float, float, float] | None:
            xs = [r[key] for r in rs if r[key] is not None]
            return (statistics.median(xs), min(xs), max(xs)) if xs else None

        rows.append({"multiple": mult, "wait_p50_s": med("wait_p50_s"),
                     "wait_p99_s": med("wait_p99_s"), "server_p50_s": med("server_p50_s"),
                     "server_p99_s": med("server_p99_s"),
                     "throughput_rps": med("throughput_rps"),
                     "vs_1x": (statistics.median(vs), min(vs), max(vs)) if vs else None,
                     "share_429": med("share_429"), "loadavg": med("loadavg"),
                     "window_429": med("window_429"),
                     **{f"{s}_p99_s": med(f"{s}_p99_s") for s in (*STAGES, "client")},
                     "failed": sum(r["failed"] for r in mine),
                     "429_without_retry_after": sum(
                         round(r["share_429"] * r["sent"]) - r["retry_after_429"]
                         for r in mine)})
    return rows


def goals(rows: list[dict[str, Any]], limit: float) -> dict[str, bool | None]:
    by = {r["multiple"]: r for r in rows}
    top = by.get(10.0)
    return {
        f"admitted p99 wait at 10× ≤ 2 × {limit:g} s": (
            top["wait_p99_s"][0] <= 2 * limit if top and top["wait_p99_s"] else None),
        "throughput at 10× ≥ 0.9× of 1×": (
            top["vs_1x"][0] >= 0.9 if top and top["vs_1x"] else None),
    }


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.0f} ms"


def _spread(t: tuple[float, float, float] | None, fmt: str = "ms") -> str:
    if t is None:
        return "-"
    if fmt == "ms":
        return f"{_ms(t[0])} [{t[1] * 1000:.0f}–{t[2] * 1000:.0f}]"
    if fmt == "x":
        return f"{t[0]:.2f}× [{t[1]:.2f}–{t[2]:.2f}]"
    if fmt == "%":
        return f"{t[0] * 100:.0f}%"
    return f"{t[0]:.2f} [{t[1]:.2f}–{t[2]:.2f}]"


def report(res: dict[str, Any], args: argparse.Namespace) -> None:
    cap = res["capacity"]
    rows = summarize(res, args.loads)
    print(f"\ntwo nodes, {args.size} model (fp32), divided cores; chat streams of "
          f"{args.max_tokens} tokens; engine.max_queue_delay_s {args.limit:g} s; "
          f"scheduler admission windows {'off' if args.no_window else 'on'}")
    print(f"capacity {cap['capacity_rps']:.2f} req/s ({cap['clients']} clients, closed loop)")
    print(f"\nPoisson arrivals, {args.duration:g} s per level, {args.reps} reps in rotated "
          "order; median [range] over reps; wait = time to first token of the 200s")
    print("| load | admitted p50 wait | admitted p99 wait | p99 / limit | scheduler p50 / p99 "
          "| throughput req/s | vs 1× | 429 | load avg |")
    print("| --- " * 9 + "|")
    for r in rows:
        p99 = r["wait_p99_s"]
        ratio = f"{p99[0] / args.limit:.2f}×" if p99 else "-"
        sp50, sp99 = r["server_p50_s"], r["server_p99_s"]
        server = f"{_ms(sp50[0] if sp50 else None)} / {_ms(sp99[0] if sp99 else None)}"
        print(f"| {r['multiple']:g}× | {_spread(r['wait_p50_s'])} | {_spread(p99)} | {ratio} "
              f"| {server} | {_spread(r['throughput_rps'], 'f')} | {_spread(r['vs_1x'], 'x')} "
              f"| {_spread(r['share_429'], '%')} | {_spread(r['loadavg'], 'f')} |")
    print("\nwhere the admitted requests' time to first token went, p99 of each stage (the "
          "scheduler's histograms): scheduler = arrival to the node call (routing, nodes "
          "that refused it); to_engine = on through the node manager to the engine; "
          "engine = the engine's receipt to its first token; back = the token's way back "
          "to the scheduler; client = this load generator's "
          "own event-loop lag (in every wait it measures); 429s at the scheduler = the "
          "share of the 429s its admission windows gave (before any node saw the request)")
    print("| load | " + " | ".join((*STAGES, "client")) + " | 429s at the scheduler |")
    print("| --- " * (len(STAGES) + 3) + "|")
    for r in rows:
        print(f"| {r['multiple']:g}× | "
              + " | ".join(_spread(r[f"{s}_p99_s"]) for s in (*STAGES, "client"))
              + f" | {_spread(r['window_429'], '%')} |")
    failed = sum(r["failed"] for r in rows)
    bare = sum(r["429_without_retry_after"] for r in rows)
    print(f"\nother outcomes (503, timeouts, errors): {failed}; 429s without Retry-After: {bare}")
    print("\ngoals")
    for name, ok in goals(rows, args.limit).items():
        print(f"  {name}: {'n/a' if ok is None else 'met' if ok else 'NOT met'}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="overture-admission-") as tmp:
        wd = Path(tmp)
        config = wd / "admission.yaml"
        # (the scheduler's admission windows aim at the same limit as the engines)
        config.write_text(f"engine:\n  max_queue_delay_s: {args.limit}\n"
                          f"scheduler:\n  admission_wait_s: {args.limit}\n"
                          f"  admission_window: {'false' if args.no_window else 'true'}\n")
        with overture_up(wd, size=args.size, cores="divided",
                         extra_args=["--config", str(config)],
                         ready_timeout=args.ready_timeout, label="admission") as c:
            return asyncio.run(run_levels(c.url, c.model, args))


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--loads", type=_floats, default=[1.0, 2.0, 10.0],
                   help="load levels, multiples of the capacity (1 must be among them) [1,2,10]")
    p.add_argument("--reps", type=int, default=2, help="runs of every level [2]")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per level [20]")
    p.add_argument("--no-window", action="store_true",
                   help="without the scheduler's admission windows (the engines alone)")
    p.add_argument("--limit", type=float, default=0.5,
                   help="engine.max_queue_delay_s of the cluster, seconds [0.5]")
    p.add_argument("--capacity-clients", type=int, default=32,
                   help="closed-loop clients measuring the capacity [32]")
    p.add_argument("--capacity-duration", type=float, default=15.0,
                   help="seconds the capacity is measured over [15]")
    p.add_argument("--warmup", type=float, default=5.0, help="closed-loop warm-up, s [5]")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per request [16]")
    p.add_argument("--request-timeout", type=float, default=30.0,
                   help="client timeout per request, seconds [30]")
    p.add_argument("--pause", type=float, default=3.0, help="seconds between levels [3]")
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds for overture up to serve")
    p.add_argument("--size", default="small", choices=("tiny", "small"),
                   help="the demo model (tiny: a smoke run) [small]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raw", action="store_true", help="also print everything as JSON")
    args = p.parse_args(argv)
    if 1.0 not in args.loads or min(args.loads) <= 0 or args.reps < 1:
        p.error("--loads needs positive multiples including 1; --reps at least 1")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    show_progress()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    res = run(args)
    report(res, args)
    if args.raw:
        print(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
