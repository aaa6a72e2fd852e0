"""Overload on a two-node cluster: goodput and rejections past capacity; decode throughput
with each node's cores divided versus shared.

    python -m bench.cluster.overload [--phases overload,decode] [--duration 20]
        [--ttft-slo 2.0] [--capacity-clients 32] [--capacity-duration 20] [--max-tokens 16]
        [--decode-tokens 64] [--decode-streams 8,64] [--decode-cores divided,shared]
        [--size small] [--raw] [--keep-dir]

A real cluster as a user starts it: ``overture up --nodes 2 --size small --no-s3`` (the
random-weight `small` demo model, fp32; ``bench.harness.overture_up``) as a subprocess in
a temporary directory, driven over HTTP with streamed ``/v1/chat/completions`` (a short
prompt that differs per request, ``ignore_eos``, temperature 0) from one aiohttp client
in this process (``chat_client``).

overload (``--cores divided``)
    Capacity: C clients in a closed loop for D seconds after a warm-up; completed
    requests/s. Then Poisson arrivals at 0.5×, 1×, 2× and 10× that capacity for
    ``--duration`` seconds each (requests still in flight at the end are awaited, bounded
    by ``--request-timeout``; a pause between levels lets queues drain). Per level:
    goodput = requests answered 200 whose time to first token is within ``--ttft-slo``,
    per second of the level; the share of 200 / 429 / 503 / client timeouts / errors (an
    SSE ``{"error": ...}`` event, a cut stream, a connection failure) / other statuses;
    p50 / p99 TTFT of the 200s. A 429 is counted, not retried.
decode
    N streams (8 and 64) of ``--decode-tokens`` tokens started at once; aggregate decode
    tokens/s = completion tokens (``usage``) / wall time until the last one finishes. On
    a divided-cores cluster and then on a ``--cores shared`` one (every engine on every
    core: the baseline), ratio divided / shared. Both run with the engines' queue-delay
    admission off (``engine.max_queue_delay_s: 0``), so that every stream of the burst
    is taken (this phase measures cores, not back-pressure).

Goals (issue): no 503 and no timeout at any load while both nodes are alive; goodput at
10× no lower than at 1×; divided cores ≥ 5× the aggregate decode of shared ones.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import resource
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.cluster.chat_client import OUTCOMES, Client, Result
from bench.harness import overture_up, show_progress

PHASES = ("overload", "decode")
CORES = ("divided", "shared")


def log_line(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# statistics


def pct(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``values`` (None: no values)."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


@dataclass
class Level:
    name: str
    rate: float  # offered requests/s (0: closed loop)
    duration: float
    results: list[Result] = field(default_factory=list)

    def summary(self, slo: float) -> dict[str, Any]:
        n = len(self.results)
        counts = Counter(r.outcome for r in self.results)
        ok = [r for r in self.results if r.outcome == "200"]
        ttfts = [r.ttft for r in ok if r.ttft is not None]
        good = sum(1 for t in ttfts if t <= slo)
        details = Counter(r.detail for r in self.results if r.outcome != "200")
        return {
            "level": self.name, "offered_rps": self.rate, "duration_s": self.duration,
            "sent": n, "goodput_rps": good / self.duration,
            "counts": {o: counts.get(o, 0) for o in OUTCOMES},
            "shares": {o: counts.get(o, 0) / n if n else 0.0 for o in OUTCOMES},
            "retry_after_429": sum(1 for r in self.results
                                   if r.outcome == "429" and r.retry_after is not None),
            "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99),
            "latency_p50_s": pct([r.latency for r in ok], 0.5),
            "failures": dict(details.most_common()),
        }


# ---------------------------------------------------------------------------------------
# phases


async def measure_capacity(client: Client, clients: int, warmup: float, duration: float,
                           max_tokens: int, timeout: float) -> dict[str, Any]:
    """Closed loop: ``clients`` workers, each sending its next request when one ends."""
    t_measure = time.perf_counter() + warmup
    t_end = t_measure + duration
    results: list[Result] = []

    async def worker() -> None:
        while time.perf_counter() < t_end:
            r = await client.request(max_tokens, timeout)
            results.append(r)
            if r.outcome != "200":
                await asyncio.sleep(0.1)  # no busy loop on instant rejections

    await asyncio.gather(*(worker() for _ in range(clients)))
    window = [r for r in results if t_measure <= r.end <= t_end]
    ok = [r for r in window if r.outcome == "200"]
    level = Level("capacity", 0.0, duration, window)
    out = level.summary(float("inf"))
    out.update(clients=clients, capacity_rps=len(ok) / duration,
               tokens_per_s=sum(r.tokens for r in ok) / duration)
    return out


async def open_loop(client: Client, name: str, rate: float, duration: float,
                    max_tokens: int, timeout: float, rng: random.Random) -> Level:
    """Poisson arrivals at ``rate`` for ``duration`` s; then await what is in flight."""
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[Result]] = []
    t0 = loop.time()
    at = t0 + rng.expovariate(rate)
    while at < t0 + duration:
        delay = at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(client.request(max_tokens, timeout)))
        at += rng.expovariate(rate)
    try:
        results = list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
    return Level(name, rate, duration, results)


async def run_overload(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    async with Client(url, model, rng) as client:
        log_line(f"capacity: {args.capacity_clients} clients, {args.warmup:g} s warm-up + "
             f"{args.capacity_duration:g} s ...")
        cap = await measure_capacity(client, args.capacity_clients, args.warmup,
                                     args.capacity_duration, args.max_tokens,
                                     args.request_timeout)
        log_line(f"capacity {cap['capacity_rps']:.2f} req/s")
        levels: list[dict[str, Any]] = []
        if cap["capacity_rps"] <= 0:
            log_line("no request completed in the capacity run; skipping the load levels")
            return {"capacity": cap, "levels": levels}
        for mult in args.loads:
            await asyncio.sleep(args.pause)
            rate = mult * cap["capacity_rps"]
            log_line(f"load {mult:g}×: {rate:.2f} req/s for {args.duration:g} s ...")
            level = await open_loop(client, f"{mult:g}×", rate, args.duration,
                                    args.max_tokens, args.request_timeout, rng)
            s = level.summary(args.ttft_slo)
            s["multiple"] = mult
            levels.append(s)
            log_line(f"  sent {s['sent']}, goodput {s['goodput_rps']:.2f} req/s, "
                 + ", ".join(f"{o} {c}" for o, c in s["counts"].items() if c))
    return {"capacity": cap, "levels": levels}


async def run_decode(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed + 1)
    out: dict[str, Any] = {}
    async with Client(url, model, rng) as client:
        # Warm every path (first-touch costs, both nodes) before timing anything.
        await asyncio.gather(*(client.request(8, args.decode_timeout)
                               for _ in range(min(args.decode_streams))))
        for streams in args.decode_streams:
            runs: list[dict[str, Any]] = []
            for _ in range(args.decode_reps):
                await asyncio.sleep(args.pause / 2)
                t0 = time.perf_counter()
                results = await asyncio.gather(*(
                    client.request(args.decode_tokens, args.decode_timeout)
                    for _ in range(streams)))
                wall = time.perf_counter() - t0
                ok = [r for r in results if r.outcome == "200"]
                tokens = sum(r.tokens for r in ok)
                runs.append({"wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall,
                             "ok": len(ok), "ttft_p50_s": pct([r.ttft for r in ok
                                                               if r.ttft is not None], 0.5),
                             "failures": dict(Counter(r.detail for r in results
                                                      if r.outcome != "200"))})
                log_line(f"  {streams} streams: {tokens} tokens in {wall:.1f} s = "
                     f"{tokens / wall:.1f} tok/s ({len(ok)}/{streams} ok)")
            best = max(runs, key=lambda r: r["tok_per_s"])
            out[str(streams)] = {**best, "runs": runs}
    return out


# ---------------------------------------------------------------------------------------
# report


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.0f} ms"


def report(res: dict[str, Any], args: argparse.Namespace) -> None:
    over = res.get("overload")
    if over:
        cap = over["capacity"]
        print(f"\ntwo nodes, {args.size} model (fp32), divided cores; chat streams of "
              f"{args.max_tokens} tokens")
        print(f"capacity {cap['capacity_rps']:.2f} req/s ({cap['clients']} clients, closed "
              f"loop, {args.capacity_duration:g} s; {cap['tokens_per_s']:.0f} tok/s, p50 TTFT "
              f"{_ms(cap['ttft_p50_s'])}, p50 latency {_ms(cap['latency_p50_s'])}; failed "
              f"{sum(cap['counts'].values()) - cap['counts']['200']})")
        base = next((lv["goodput_rps"] for lv in over["levels"] if lv["multiple"] == 1), None)
        print(f"\nPoisson arrivals, {args.duration:g} s per level; goodput = 200s with TTFT ≤ "
              f"{args.ttft_slo:g} s per second")
        print("| load | offered req/s | sent | goodput req/s | vs 1× | 200 | 429 | 503 "
              "| timeout | error | other | p50 TTFT | p99 TTFT |")
        print("| --- " * 13 + "|")
        for lv in over["levels"]:
            sh = lv["shares"]
            vs = f"{lv['goodput_rps'] / base:.2f}×" if base else "-"
            print(f"| {lv['level']} | {lv['offered_rps']:.2f} | {lv['sent']} | "
                  f"{lv['goodput_rps']:.2f} | {vs} | "
                  + " | ".join(f"{sh[o] * 100:.0f}%" for o in OUTCOMES)
                  + f" | {_ms(lv['ttft_p50_s'])} | {_ms(lv['ttft_p99_s'])} |")
        for lv in over["levels"]:
            if lv["failures"]:
                extra = (f" (Retry-After on {lv['retry_after_429']})"
                         if lv["counts"]["429"] else "")
                print(f"  {lv['level']} failures: "
                      + ", ".join(f"{k} ×{v}" for k, v in lv["failures"].items()) + extra)
    dec = res.get("decode")
    if dec:
        print(f"\naggregate decode tokens/s, {args.decode_tokens}-token streams started at "
              "once (completion tokens / wall time)")
        print("| streams | divided | shared | divided / shared |")
        print("| --- | --- | --- | --- |")
        for n in args.decode_streams:
            d, s = dec.get("divided", {}).get(str(n)), dec.get("shared", {}).get(str(n))
            ratio = (f"{d['tok_per_s'] / s['tok_per_s']:.2f}×"
                     if d and s and s["tok_per_s"] > 0 else "-")
            print(f"| {n} | {d['tok_per_s'] if d else 0:.1f} | "
                  f"{s['tok_per_s'] if s else 0:.1f} | {ratio} |")
    print("\ngoals")
    for name, ok in goals(res, args).items():
        print(f"  {name}: {'n/a' if ok is None else 'met' if ok else 'NOT met'}")


def goals(res: dict[str, Any], args: argparse.Namespace) -> dict[str, bool | None]:
    out: dict[str, bool | None] = {}
    levels = (res.get("overload") or {}).get("levels") or []
    out["no 503 and no timeout at any load"] = (
        all(lv["counts"]["503"] == 0 and lv["counts"]["timeout"] == 0 for lv in levels)
        if levels else None)
    by = {lv["multiple"]: lv["goodput_rps"] for lv in levels}
    out["goodput at 10× ≥ at 1×"] = by[10] >= by[1] if 10 in by and 1 in by else None
    dec = res.get("decode") or {}
    for n in args.decode_streams:
        d = dec.get("divided", {}).get(str(n))
        s = dec.get("shared", {}).get(str(n))
        out[f"divided ≥ 5× shared decode, {n} streams"] = (
            d["tok_per_s"] >= 5 * s["tok_per_s"] if d and s else None)
    return out


# ---------------------------------------------------------------------------------------
# main


@contextlib.contextmanager
def _workdir(args: argparse.Namespace) -> Iterator[Path]:
    if args.workdir:
        path = Path(args.workdir).resolve()
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix="overture-overload-"))
    try:
        yield path
    finally:
        if args.keep_dir:
            log_line(f"kept {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"args": dict(vars(args))}
    extra = shlex.split(args.extra_up_args)
    with _workdir(args) as wd:
        if "overload" in args.phases:
            with overture_up(wd, size=args.size, cores="divided", extra_args=extra,
                             ready_timeout=args.ready_timeout, label="overload") as c:
                res["overload"] = asyncio.run(run_overload(c.url, c.model, args))
        if "decode" in args.phases:
            # All N streams must run at once: the engines' queue-delay admission (which
            # would turn part of a simultaneous burst away) is off for this phase.
            decode_config = wd / "decode.yaml"
            decode_config.write_text("engine:\n  max_queue_delay_s: 0\n")
            decode_extra = [*extra, "--config", str(decode_config)]
            res["decode"] = {}
            for cores in args.decode_cores:
                with overture_up(wd, size=args.size, cores=cores, extra_args=decode_extra,
                                 ready_timeout=args.ready_timeout,
                                 label=f"decode-{cores}") as c:
                    log_line(f"decode, {cores} cores ...")
                    res["decode"][cores] = asyncio.run(run_decode(c.url, c.model, args))
    res["goals"] = goals(res, args)
    return res


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--phases", default=",".join(PHASES),
                   help="comma-separated subset of: " + ", ".join(PHASES))
    p.add_argument("--ttft-slo", type=float, default=2.0,
                   help="seconds to first token for a request to count as goodput [2.0]")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per load level [20]")
    p.add_argument("--loads", type=_floats, default=[0.5, 1.0, 2.0, 10.0],
                   help="load levels as multiples of the capacity [0.5,1,2,10]")
    p.add_argument("--capacity-clients", type=int, default=32,
                   help="closed-loop clients measuring the capacity [32]")
    p.add_argument("--capacity-duration", type=float, default=20.0,
                   help="seconds the capacity is measured over [20]")
    p.add_argument("--warmup", type=float, default=5.0,
                   help="closed-loop seconds before the capacity window [5]")
    p.add_argument("--max-tokens", type=int, default=16,
                   help="tokens per request in the overload phase [16]")
    p.add_argument("--request-timeout", type=float, default=30.0,
                   help="client timeout per overload request, seconds [30]")
    p.add_argument("--pause", type=float, default=5.0,
                   help="seconds between levels, for queues to drain [5]")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens per stream [64]")
    p.add_argument("--decode-streams", type=_ints, default=[8, 64],
                   help="concurrent streams, comma-separated [8,64]")
    p.add_argument("--decode-reps", type=int, default=1,
                   help="runs per stream count (the best is reported) [1]")
    p.add_argument("--decode-cores", type=_names, default=list(CORES),
                   help="the decode phase's clusters, comma-separated [divided,shared]")
    p.add_argument("--decode-timeout", type=float, default=300.0,
                   help="client timeout per decode stream, seconds [300]")
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds for overture up to serve (the first run writes the model)")
    p.add_argument("--size", default="small", choices=("tiny", "small"),
                   help="the demo model (tiny: a smoke run) [small]")
    p.add_argument("--extra-up-args", default="", help="more flags for overture up")
    p.add_argument("--workdir", default=None,
                   help="run overture up here (kept; reuses its demo model) instead of a "
                   "temporary directory")
    p.add_argument("--keep-dir", action="store_true",
                   help="keep the temporary directory (logs, .overture)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raw", action="store_true", help="also print everything as JSON")
    args = p.parse_args(argv)
    args.phases = [x for x in args.phases.split(",") if x.strip()]
    unknown = set(args.phases) - set(PHASES)
    if unknown or not args.phases:
        p.error(f"unknown phases {sorted(unknown)}; known: {', '.join(PHASES)}")
    if not args.loads or min(args.loads) <= 0 or not args.decode_streams:
        p.error("--loads and --decode-streams need positive values")
    if not args.decode_cores or set(args.decode_cores) - set(CORES):
        p.error(f"--decode-cores: a subset of {', '.join(CORES)}")
    # Thousands of open streams at 10× when the cluster queues instead of rejecting.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    show_progress()
    # SIGTERM unwinds like Ctrl-C, so the cluster is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    res = run(args)
    report(res, args)
    if args.raw:
        print(json.dumps(res, indent=1, default=_json_default))


def _json_default(o: object) -> Any:
    if isinstance(o, Result):
        return asdict(o)
    return str(o)


if __name__ == "__main__":
    main()
