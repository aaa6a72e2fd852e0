"""ReAct tool loops through the OpenAI Agents SDK, unchanged, against ``/v1/responses``:
job completion time and per-turn latency with and without the advisories the scheduler
infers from tool calls (issue 41).

    python -m bench.agents.tool_loop [--jobs 1,6] [--calls 5,20] [--latency 0.3,5]
        [--reps 3] [--size small] [--device-mb 96] [--variants ...]

One cluster per variant (scheduler, two nodes of kvstore + engine + node manager, the demo
model in fp32), each node's device KV budget ``--device-mb`` so that the jobs' sessions do
not all fit at once. A job is one ``agents.Agent`` with a long shared system prompt and one
tool; each turn must call it (``tool_choice="required"``) until the job's drawn number of
calls (``--calls`` lo,hi) is made; the tool sleeps a drawn latency (``--latency`` lo,hi
seconds). ``--jobs`` lists the concurrency levels: 1 is workload (2), several at once
workload (3). Variants:

- unadvised   ``balanced``, ``scheduler.infer_advisories=false`` (the baseline)
- inferred    ``balanced``, advisories inferred from tool-call turns (the default)
- sticky      a session stays on its first node (InferCept-like)
- recompute   no KV reuse at all

Replays are paired: rep r draws the same jobs (calls, latencies, prompts) under every
variant (seed r). Printed per variant and concurrency: mean job completion time, mean and
p95 per-turn latency (a whole non-streamed Responses call: prefill plus a few decoded
tokens), where the turns' KV came from, and the ratio of mean job time to ``unadvised``
with a 95% interval over the paired reps.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import Field

from bench.eval.stats import paired_ratio
from bench.harness import Cluster, start_cluster
from services.engine.model import write_demo_model

VARIANTS = {
    "unadvised": {"policy": "balanced", "infer_advisories": "false"},
    "inferred": {"policy": "balanced", "infer_advisories": "true"},
    "sticky": {"policy": "sticky", "infer_advisories": "false"},
    "recompute": {"policy": "recompute", "infer_advisories": "false"},
}
RULES = ("You are one worker of a research team. Follow the team's rules: use the lookup "
         "tool for every fact, cite what it returns, keep answers short, never guess. ")


@dataclass(frozen=True)
class Job:
    task: str
    calls: int
    latencies: tuple[float, ...]


@dataclass
class Sample:
    job_s: list[float] = field(default_factory=list)
    turn_s: list[float] = field(default_factory=list)
    kv_from: dict[str, float] = field(default_factory=dict)


def draw_jobs(seed: int, n: int, calls: tuple[int, int], latency: tuple[float, float]
              ) -> list[Job]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        k = rnd.randint(*calls)
        out.append(Job(f"(job {seed}-{i}) find the {rnd.choice(['price', 'author', 'date'])} "
                       f"of item {rnd.randint(1, 999)}", k,
                       tuple(rnd.uniform(*latency) for _ in range(k))))
    return out


async def run_job(url: str, model: str, job: Job, turns: list[float]) -> float:
    """One Agents SDK run of ``job``; its completion time. ``turns`` gets each model
    call's latency (httpx hooks around the SDK's own client)."""
    import httpx
    import openai
    from agents import (
        Agent,
        ModelSettings,
        Runner,
        ToolsToFinalOutputResult,
        function_tool,
        set_tracing_disabled,
    )
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)
    made: list[int] = []
    started: dict[int, float] = {}

    async def on_request(request: httpx.Request) -> None:
        started[id(request)] = time.monotonic()

    async def on_response(response: httpx.Response) -> None:
        await response.aread()
        t0 = started.pop(id(response.request), None)
        if t0 is not None and response.request.url.path.endswith("/responses"):
            turns.append(time.monotonic() - t0)

    @function_tool
    async def lookup(query: Annotated[str, Field(max_length=12)]) -> str:
        """Look a fact up."""
        await asyncio.sleep(job.latencies[min(len(made), len(job.latencies) - 1)])
        made.append(1)
        return f"result {len(made)} for the query"

    def enough(_ctx: object, _results: object) -> ToolsToFinalOutputResult:
        return ToolsToFinalOutputResult(len(made) >= job.calls, "done")

    http = httpx.AsyncClient(event_hooks={"request": [on_request],
                                          "response": [on_response]}, timeout=600)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", http_client=http,
                                max_retries=0)
    agent = Agent(name="worker", instructions=RULES * 24,
                  model=OpenAIResponsesModel(model=model, openai_client=client),
                  tools=[lookup], reset_tool_choice=False, tool_use_behavior=enough,
                  model_settings=ModelSettings(tool_choice="required", max_tokens=120,
                                               parallel_tool_calls=False,
                                               temperature=0))
    t0 = time.monotonic()
    try:
        await Runner.run(agent, job.task, max_turns=job.calls + 2)
    finally:
        await http.aclose()
    return time.monotonic() - t0


def _turns_by_source(cluster: Cluster) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in cluster.text("/metrics").splitlines():
        if line.startswith("overture_turns_total{"):
            label = line.split('kv_from="', 1)[1].split('"', 1)[0]
            out[label] = out.get(label, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def run_variant(name: str, model_path: Path, work: Path, jobs: list[int], reps: int,
                calls: tuple[int, int], latency: tuple[float, float], device_mb: int
                ) -> dict[tuple[int, int], Sample]:
    out: dict[tuple[int, int], Sample] = {}
    with start_cluster(work / name, model_path, nodes=2, scheduler_flags=VARIANTS[name],
                       engine_flags={"device_memory_bytes": device_mb << 20,
                                     # every job runs: compare the routing, not the queue limit
                                     "max_queue_delay_s": 0.0,
                                     "offload.policy": "always"}) as cluster:
        model = cluster.model
        for n in jobs:
            for rep in range(reps):
                before = _turns_by_source(cluster)
                sample = Sample()
                todo = draw_jobs(1000 * n + rep, n, calls, latency)

                async def all_jobs(todo: list[Job] = todo, sample: Sample = sample) -> None:
                    times = await asyncio.gather(*(run_job(cluster.url, model, j,
                                                           sample.turn_s) for j in todo))
                    sample.job_s.extend(times)

                asyncio.run(all_jobs())
                after = _turns_by_source(cluster)
                sample.kv_from = {k: v - before.get(k, 0.0) for k, v in after.items()
                                  if v - before.get(k, 0.0) > 0}
                out[(n, rep)] = sample
                print(f"  {name:10} jobs {n} rep {rep}: mean job "
                      f"{statistics.fmean(sample.job_s):.2f}s", flush=True)
    return out


def report(results: dict[str, dict[tuple[int, int], Sample]], jobs: list[int], reps: int
           ) -> None:
    base = results.get("unadvised")
    print("\nvariant    jobs  mean job s  turn mean/p95 s  job time vs unadvised (95% CI)  "
          "turns' KV from")
    for n in jobs:
        for name, res in results.items():
            samples = [res[(n, r)] for r in range(reps)]
            job_s = [t for s in samples for t in s.job_s]
            turn_s = sorted(t for s in samples for t in s.turn_s)
            p95 = turn_s[min(len(turn_s) - 1, int(0.95 * len(turn_s)))] if turn_s else 0.0
            ratio = (paired_ratio([statistics.fmean(base[(n, r)].job_s) for r in range(reps)],
                                  [statistics.fmean(s.job_s) for s in samples]).fmt(digits=2)
                     if base else "-")
            kv: dict[str, float] = {}
            for s in samples:
                for k, v in s.kv_from.items():
                    kv[k] = kv.get(k, 0.0) + v
            print(f"{name:10} {n:4}  {statistics.fmean(job_s):10.2f}  "
                  f"{statistics.fmean(turn_s) if turn_s else 0:.3f}/{p95:.3f}        "
                  f"{ratio:30}  "
                  + ", ".join(f"{k} {int(v)}" for k, v in sorted(kv.items())))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", default="1,6", help="concurrency levels, comma-separated")
    p.add_argument("--calls", default="5,20", help="tool calls per job: lo,hi")
    p.add_argument("--latency", default="0.3,5", help="a tool's latency in seconds: lo,hi")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--size", default="small", choices=("tiny", "small"))
    p.add_argument("--device-mb", type=int, default=96, help="each node's device KV budget")
    p.add_argument("--variants", default=",".join(VARIANTS))
    a = p.parse_args(argv)
    jobs = [int(x) for x in a.jobs.split(",")]
    lo, hi = (int(x) for x in a.calls.split(","))
    llo, lhi = (float(x) for x in a.latency.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        path = write_demo_model(Path(tmp) / a.size, size=a.size, seed=0)
        results = {v: run_variant(v, path, Path(tmp), jobs, a.reps, (lo, hi), (llo, lhi),
                                  a.device_mb) for v in a.variants.split(",")}
    report(results, jobs, a.reps)


if __name__ == "__main__":
    main()
