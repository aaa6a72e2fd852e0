"""A multi-agent workflow with call-graph advisories, against a running Overture.

    overture up --nodes 2            # in another terminal (or make run ARGS="--nodes 2")
    python clients/python/examples/agent_workflow.py [--url http://127.0.0.1:8000]

Product manager -> architect -> engineer <-> QA reviewer (up to three review rounds). Each
agent keeps its own conversation (session), which grows every time it is called. The
first run profiles the workflow (and warms the caches); then ``--runs`` runs without
advisories and as many with them: each agent's likely successors are advised when it
starts (``AgentGraph``). It prints every advisory's lead time and each agent's median time
to first token, without and with advisories (the first agent is never advised: it is the
control).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from overture_client import AgentGraph, AsyncOverture

ROLES = {
    "pm": "You are a product manager. Write a short spec for the feature asked for.",
    "architect": "You are a software architect. Turn the spec into a short design.",
    "engineer": "You are a senior engineer. Write the code the design asks for.",
    "qa": "You are a QA reviewer. Review the code; say APPROVED or list the problems.",
}
FEATURE = "A command-line tool that counts the words of a text file, per line and in total."


async def _call(client: AsyncOverture, histories: dict[str, list[dict]], agent: str,
                session: str, ask: str, max_tokens: int) -> tuple[str, float]:
    """One agent turn: (its answer, its time to first token)."""
    history = histories.setdefault(agent, [{"role": "system", "content": ROLES[agent]}])
    history.append({"role": "user", "content": ask})
    started, first, parts = time.monotonic(), None, []
    async for delta in client.chat_stream(history, session_id=session, max_tokens=max_tokens,
                                          temperature=0):
        if first is None:
            first = time.monotonic() - started
        parts.append(delta)
    answer = "".join(parts)
    history.append({"role": "assistant", "content": answer})
    return answer, first if first is not None else time.monotonic() - started


async def run_workflow(client: AsyncOverture, graph: AgentGraph, max_tokens: int,
                       rounds: int = 3) -> dict[str, list[float]]:
    """One run; each agent's times to first token."""
    ttft: dict[str, list[float]] = {}
    histories: dict[str, list[dict]] = {}

    async def turn(agent: str, ask: str) -> str:
        async with graph.agent(agent) as session:
            answer, first = await _call(client, histories, agent, session, ask, max_tokens)
        ttft.setdefault(agent, []).append(first)
        return answer

    spec = await turn("pm", FEATURE)
    design = await turn("architect", spec)
    code = await turn("engineer", design)
    for review_round in range(rounds):
        review = await turn("qa", code)
        if "APPROVED" in review or review_round == rounds - 1:
            break
        code = await turn("engineer", review)
    await graph.finish()
    return ttft


def _lead_times(client: AsyncOverture) -> list[float]:
    """Seconds from each followed advisory to its session's request."""
    leads, advised = [], {}
    for e in client.events:
        if e.kind == "advise":
            advised[e.session_id] = e.at
        elif e.kind == "invalidate":
            advised.pop(e.session_id, None)
        elif e.kind == "request" and e.session_id in advised:
            leads.append(e.at - advised.pop(e.session_id))
    return leads


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=None, help="default: the cluster's first model")
    ap.add_argument("--runs", type=int, default=2,
                    help="runs without, then as many with advisories, after the profiling one")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    async with AsyncOverture(args.url, args.api_key, args.model) as client:
        if client.model is None:
            r = await client.http.get(args.url + "/v1/models", headers=client.headers())
            client.model = r.json()["data"][0]["id"]
        results = {}
        graph = None
        for mode in ["profile"] + ["plain"] * args.runs + ["advised"] * args.runs:
            run = uuid.uuid4().hex[:8]
            if graph is None:
                graph = AgentGraph(client, lambda agent, r=run: f"{r}-{agent}", client.model)
            graph.session_of = lambda agent, r=run: f"{r}-{agent}"
            graph.advising = mode == "advised"
            client.events.clear()
            ttft = await run_workflow(client, graph, args.max_tokens)
            results.setdefault(mode, []).append(ttft)
            leads = _lead_times(client)
            if leads:
                print(f"{mode} run: {len(leads)} advisories followed, lead times "
                      + ", ".join(f"{x:.2f}s" for x in leads))
        print(f"\n{'agent':10}{'TTFT no advisory':>20}{'TTFT advised':>16}")
        for agent in ROLES:
            base = [t for r in results["plain"] for t in r.get(agent, [])]
            adv = [t for r in results.get("advised", []) for t in r.get(agent, [])]
            if base:
                print(f"{agent:10}{statistics.median(base) * 1000:>18.0f}ms"
                      f"{statistics.median(adv) * 1000 if adv else float('nan'):>14.0f}ms")


if __name__ == "__main__":
    asyncio.run(main())
