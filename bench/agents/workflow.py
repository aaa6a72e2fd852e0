"""The four-agent workflow with a long shared context (issue 41, workload 1): time to first
token per agent turn and workflow completion time, with and without advisories.

    python -m bench.agents.workflow [--reps 3] [--workflows 1] [--rounds 2]
        [--context-tokens 2048] [--size small] [--device-mb 16] [--variants ...]

Product manager -> architect -> engineer -> (QA -> engineer) x (rounds - 1) -> QA; each
agent its own session, whose system message starts with the team's shared handbook
(about ``--context-tokens`` tokens, drawn per rep) and then names its role. ``--workflows``
run at once (several: many such jobs at once). One cluster per variant (scheduler, two
nodes, the demo model, ``--device-mb`` of device KV per node), a warm-up workflow first
(it teaches ``AgentGraph`` the call graph); then ``--reps`` measured ones. Variants:

- unadvised   ``balanced``, no advisory of any kind (the baseline)
- client      ``balanced``, advisories from the client SDK's ``AgentGraph``
- inferred    ``balanced``, the scheduler's inferred advisories (none here: no tool calls;
              it shows that turning them on costs this workflow nothing)
- sticky      a session stays on its first node
- recompute   no KV reuse at all: the reference every other variant's answers must equal

Paired by rep: rep r draws the same handbook and asks under every variant. Printed: per
variant the mean and p95 TTFT of a turn and the mean workflow time, each a 95% interval
over reps (``bench.eval.stats``), the ratio of workflow time to ``unadvised``, per agent the
mean TTFT against ``unadvised`` (a paired difference: lower, higher or no difference), and
how many turns' answers equal ``recompute``'s.
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

from overture_client import AgentGraph, AsyncOverture

from bench.eval.stats import compare, mean_interval, paired_ratio
from bench.harness import start_cluster
from services.engine.model import write_demo_model

VARIANTS: dict[str, dict[str, object]] = {
    "unadvised": {"policy": "balanced", "infer_advisories": "false"},
    "client": {"policy": "balanced", "infer_advisories": "false"},
    "inferred": {"policy": "balanced", "infer_advisories": "true"},
    "sticky": {"policy": "sticky", "infer_advisories": "false"},
    "recompute": {"policy": "recompute", "infer_advisories": "false"},
}
ROLES = {
    "pm": "You are the product manager. Write a short spec for the feature asked for.",
    "architect": "You are the architect. Turn the spec into a short design.",
    "engineer": "You are the engineer. Write the code the design asks for.",
    "qa": "You are the QA reviewer. Review the code; say APPROVED or list the problems.",
}
WORDS = ("module", "interface", "latency", "budget", "review", "release", "owner", "test",
         "schema", "deadline", "cache", "rollback", "metric", "incident", "design", "spec")


@dataclass
class Run:
    """One measured workflow: its turns' TTFTs by agent, answers in order, its time."""
    ttft: dict[str, list[float]] = field(default_factory=dict)
    answers: list[str] = field(default_factory=list)
    seconds: float = 0.0


def handbook(seed: int, tokens: int) -> str:
    """The team's shared context: about ``tokens`` tokens of rules (the demo tokenizer
    makes a word of these, with its space, about four tokens; the run prints the count)."""
    rnd = random.Random(seed)
    words = [rnd.choice(WORDS) for _ in range(tokens // 4)]
    lines = [" ".join(words[i:i + 12]) + "." for i in range(0, len(words), 12)]
    return f"Team handbook {seed}:\n" + "\n".join(lines)


def plan(rounds: int) -> list[str]:
    return ["pm", "architect", "engineer", *["qa", "engineer"] * (rounds - 1), "qa"]


async def workflow(client: AsyncOverture, graph: AgentGraph, shared: str, tag: str,
                   rounds: int, max_tokens: int) -> Run:
    graph.session_of = lambda agent: f"{tag}-{agent}"  # (what its advisories name too)
    run = Run()
    histories: dict[str, list[dict[str, str]]] = {}
    ask = "A tool that counts the words of a text file, per line and in total."
    t0 = time.monotonic()
    for agent in plan(rounds):
        history = histories.setdefault(agent, [
            {"role": "system", "content": f"{shared}\n\n{ROLES[agent]}"}])
        history.append({"role": "user", "content": ask})
        async with graph.agent(agent) as session:
            started, first, parts = time.monotonic(), None, []
            async for delta in client.chat_stream(history, session_id=session,
                                                  max_tokens=max_tokens, temperature=0,
                                                  ignore_eos=True):
                first = first if first is not None else time.monotonic() - started
                parts.append(delta)
        ask = "".join(parts)
        history.append({"role": "assistant", "content": ask})
        run.ttft.setdefault(agent, []).append(first or time.monotonic() - started)
        run.answers.append(ask)
    await graph.finish()
    run.seconds = time.monotonic() - t0
    return run


def run_variant(name: str, model_path: Path, work: Path, a: argparse.Namespace
                ) -> list[list[Run]]:
    """Per rep, the ``--workflows`` runs made at once."""
    out: list[list[Run]] = []
    with start_cluster(work / name, model_path, nodes=2, scheduler_flags=VARIANTS[name],
                       engine_flags={"device_memory_bytes": a.device_mb << 20,
                                     # every job runs: compare the routing, not the queue limit
                                     "max_queue_delay_s": 0.0,
                                     "offload.policy": "always"}) as cluster:

        async def go() -> None:
            async with AsyncOverture(cluster.url, None, cluster.model, 600) as client:
                graphs = [AgentGraph(client, str, cluster.model) for _ in range(a.workflows)]
                for rep in range(-1, a.reps):  # rep -1: the warm-up, which teaches the graph
                    for g in graphs:
                        g.advising = name == "client" and rep >= 0
                    shared = handbook(rep, a.context_tokens)
                    if rep == -1:
                        probe = await client.chat([{"role": "user", "content": shared}],
                                                  max_tokens=1)
                        print(f"  {name:10} shared context: "
                              f"{probe.usage['prompt_tokens']} tokens", flush=True)
                    runs = await asyncio.gather(*(
                        workflow(client, g, shared, f"r{rep}w{i}", a.rounds, a.max_tokens)
                        for i, g in enumerate(graphs)))
                    if rep >= 0:
                        out.append(list(runs))
                        print(f"  {name:10} rep {rep}: workflow "
                              f"{statistics.fmean(r.seconds for r in runs):.2f}s", flush=True)

        asyncio.run(go())
    return out


def _p95(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.95 * len(s)))]


def report(results: dict[str, list[list[Run]]]) -> None:
    def per_rep(name: str, f: object) -> list[float]:
        return [f(reps) for reps in results[name]]  # type: ignore[operator]

    def turns(reps: list[Run], agent: str | None = None) -> list[float]:
        return [t for r in reps for a, ts in r.ttft.items() if agent in (None, a) for t in ts]

    base = "unadvised" if "unadvised" in results else None
    ref = results.get("recompute")
    print("\nvariant     TTFT mean ms        TTFT p95 ms         workflow s       "
          "vs unadvised (x)   = recompute")
    for name in results:
        mean = mean_interval(per_rep(name, lambda reps: statistics.fmean(turns(reps))))
        p95 = mean_interval(per_rep(name, lambda reps: _p95(turns(reps))))
        job = per_rep(name, lambda reps: statistics.fmean(r.seconds for r in reps))
        ratio = (paired_ratio(per_rep(base, lambda reps: statistics.fmean(
            r.seconds for r in reps)), job).fmt(digits=2) if base else "-")
        same = "-"
        if ref is not None:
            pairs = [(x, y) for mine, theirs in zip(results[name], ref, strict=True)
                     for rm, rr in zip(mine, theirs, strict=True)
                     for x, y in zip(rm.answers, rr.answers, strict=True)]
            same = f"{sum(x == y for x, y in pairs)}/{len(pairs)}"
        print(f"{name:10}  {mean.fmt(1000):18}  {p95.fmt(1000):18}  "
              f"{mean_interval(job).fmt(digits=2):15}  {ratio:18}  {same}")
    if base is None:
        return
    print("\nper agent, mean TTFT ms (vs unadvised: a paired difference over reps)")
    for name in results:
        cells = []
        for agent in ROLES:
            mine = per_rep(name, lambda reps, a=agent: statistics.fmean(turns(reps, a)))
            theirs = per_rep(base, lambda reps, a=agent: statistics.fmean(turns(reps, a)))
            word = compare(mine, theirs) if len(mine) > 1 and name != base else ""
            cells.append(f"{agent} {statistics.fmean(mine) * 1000:.0f}"
                         + (f" ({word})" if word else ""))
        print(f"{name:10}  " + ", ".join(cells))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--workflows", type=int, default=1, help="workflows run at once")
    p.add_argument("--rounds", type=int, default=2, help="QA reviews per workflow")
    p.add_argument("--context-tokens", type=int, default=2048, help="the shared handbook")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens an agent answers")
    p.add_argument("--size", default="small", choices=("tiny", "small"))
    p.add_argument("--device-mb", type=int, default=16, help="each node's device KV budget")
    p.add_argument("--variants", default=",".join(VARIANTS))
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_demo_model(Path(tmp) / a.size, size=a.size, seed=0)
        results = {v: run_variant(v, path, Path(tmp), a) for v in a.variants.split(",")}
    report(results)


if __name__ == "__main__":
    main()
