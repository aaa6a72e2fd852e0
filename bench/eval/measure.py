"""One replay against a running cluster, measured: the requests (``bench.workloads.replay``),
each node's load over time (running + waiting, from ``/readyz``, Symphony Figure 15) and
what the scheduler counted meanwhile (turns by where their KV came from, bytes advisories
prefetched into device memory, from ``/metrics``), and the bytes each node's kvstore moved
per tier (its own ``/metrics``, found through ``GET /admin/nodes``, which ``overture up``
fills by default)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
from dataclasses import dataclass, field

import aiohttp

from bench.workloads.replay import Replayer, Result
from bench.workloads.trace import Trace

LOAD_PERIOD_S = 0.25
_SAMPLE = re.compile(r'^(overture_turns_total|overture_node_prefetch_bytes)\{([^}]*)\} (\S+)$')
_TIER = re.compile(r'^kvstore_bytes_(in|out)_total\{tier="([^"]*)"\} (\S+)$')


@dataclass
class Measured:
    results: list[Result]
    load: list[tuple[float, dict[str, int]]]  # (seconds since start, node -> load)
    turns_by_source: dict[str, float] = field(default_factory=dict)
    prefetch_bytes: dict[str, float] = field(default_factory=dict)  # loaded, wasted
    advisories: int = 0
    tier_bytes: dict[str, float] = field(default_factory=dict)  # "out:dram" -> bytes, all nodes


def tagged(trace: Trace, tag: str) -> Trace:
    """``trace`` with session ids unique to one replay (a cluster replays several)."""
    return Trace([dataclasses.replace(s, session_id=f"{tag}-{s.session_id}")
                  for s in trace.sessions])


async def _metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Turn counts by KV source and prefetched bytes by kind (summed over nodes)."""
    try:
        async with http.get(url + "/metrics") as r:
            if r.status != 200:
                return {}
            text = await r.text()
    except aiohttp.ClientError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(kv.split("=", 1) for kv in m.group(2).split(","))
        if m.group(1) == "overture_turns_total":
            key = "turns:" + labels.get("kv_from", '""').strip('"')
        else:
            key = "prefetch:" + labels.get("kind", '""').strip('"')
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


async def kvstore_urls(http: aiohttp.ClientSession, url: str) -> list[str]:
    """Every node's kvstore /metrics URL, as the scheduler lists them."""
    try:
        async with http.get(url + "/admin/nodes") as r:
            body = await r.json() if r.status == 200 else {}
    except (aiohttp.ClientError, ValueError):
        return []
    return [m["kvstore"] for n in body.get("nodes", []) if (m := n.get("metrics"))
            and "kvstore" in m]


async def tier_bytes(http: aiohttp.ClientSession, urls: list[str]) -> dict[str, float]:
    """Bytes written into ("in:<tier>") and read from ("out:<tier>") each tier, summed over
    the kvstores (cumulative counters)."""
    out: dict[str, float] = {}
    for u in urls:
        try:
            async with http.get(u) as r:
                text = await r.text() if r.status == 200 else ""
        except aiohttp.ClientError:
            continue
        for line in text.splitlines():
            if m := _TIER.match(line):
                key = f"{m.group(1)}:{m.group(2)}"
                out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


async def _sample_load(http: aiohttp.ClientSession, url: str, t0: float,
                       out: list[tuple[float, dict[str, int]]]) -> None:
    while True:
        with contextlib.suppress(aiohttp.ClientError, ValueError):
            async with http.get(url + "/readyz") as r:
                body = await r.json()
            out.append((time.monotonic() - t0, {
                node: int(v.get("running", 0)) + int(v.get("waiting", 0))
                for node, v in body.get("nodes", {}).items()}))
        await asyncio.sleep(LOAD_PERIOD_S)


async def measure(url: str, model: str, trace: Trace, time_scale: float,
                  max_answer_tokens: int) -> Measured:
    """Replay ``trace`` while sampling the nodes' load."""
    load: list[tuple[float, dict[str, int]]] = []
    async with aiohttp.ClientSession() as http:
        before = await _metrics(http, url)
        kvstores = await kvstore_urls(http, url)
        tiers_before = await tier_bytes(http, kvstores)
        sampler = asyncio.create_task(_sample_load(http, url, time.monotonic(), load))
        replayer = Replayer(url, model, time_scale=time_scale,
                            max_answer_tokens=max_answer_tokens)
        try:
            results = await replayer.run(trace)
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        after = await _metrics(http, url)
        tiers_after = await tier_bytes(http, kvstores)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    moved = {k: v - tiers_before.get(k, 0.0) for k, v in tiers_after.items()}
    return Measured(
        results, load,
        {k.split(":", 1)[1]: v for k, v in delta.items() if k.startswith("turns:") and v},
        {k.split(":", 1)[1]: v for k, v in delta.items() if k.startswith("prefetch:")},
        replayer.advisories,
        {k: v for k, v in moved.items() if v},
    )


def imbalance(load: list[tuple[float, dict[str, int]]]) -> float:
    """Max over median of the nodes' time-averaged load (Symphony §4.3); 1.0 is even."""
    totals: dict[str, float] = {}
    for _, per_node in load:
        for node, n in per_node.items():
            totals[node] = totals.get(node, 0.0) + n
    values = sorted(totals.values())
    if not values or values[-1] == 0:
        return 1.0
    mid = len(values) // 2
    median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    return values[-1] / median if median > 0 else float("inf")
