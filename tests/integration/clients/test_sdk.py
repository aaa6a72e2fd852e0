"""The Python SDK against real local services: chat under a session (blocking, async,
streaming), advisories, the official openai client with the session header; agent call
graphs advise the next agents before their requests and invalidate the branches not
taken; the LangGraph adapter advises what the graph's edges say."""

from __future__ import annotations

import asyncio
import operator
from typing import Annotated, TypedDict

import openai
import pytest
from overture_client import END, AgentGraph, AsyncOverture, Overture

from tests.cluster import Cluster

MODEL = "demo-tiny"
ASK = [{"role": "system", "content": "You are terse. " * 20},
       {"role": "user", "content": "Name a colour."}]


def _followed(cluster: Cluster) -> float:
    for line in cluster.text("/metrics").splitlines():
        if line.startswith('overture_advisories_total{event="followed",source="client"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_openai_client_with_the_session_header_reuses_its_kv(cluster: Cluster) -> None:
    sdk = Overture(cluster.url, model=MODEL)
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused",
                           default_headers=sdk.session_headers("openai-1"))
    first = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                           temperature=0)
    follow = [*ASK, {"role": "assistant", "content": first.choices[0].message.content},
              {"role": "user", "content": "Another."}]
    second = client.chat.completions.create(model=MODEL, messages=follow, max_tokens=4,
                                            temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_blocking_and_async_clients(cluster: Cluster) -> None:
    with Overture(cluster.url, model=MODEL) as sdk:
        whole = sdk.chat(ASK, session_id="sync-1", max_tokens=6, temperature=0)
        streamed = "".join(sdk.chat_stream(ASK, session_id="sync-2", max_tokens=6,
                                           temperature=0))
        assert whole.content == streamed and whole.node == "node0"
        adv = sdk.advise("sync-1", expected_arrival_s=2.0)
        assert adv.node == "node0" and adv.session_id == "sync-1"
        assert sdk.invalidate(adv.advisory_id) is True
        assert sdk.invalidate(adv.advisory_id) is False  # (gone)
        with pytest.raises(Exception, match="does not exist"):
            sdk.chat(ASK, model="no-such-model")

    async def run() -> tuple[str, int]:
        async with AsyncOverture(cluster.url, model=MODEL) as sdk:
            first = await sdk.chat(ASK, session_id="async-1", max_tokens=6, temperature=0)
            parts = [d async for d in sdk.chat_stream(ASK, session_id="async-1",
                                                      max_tokens=6, temperature=0)]
            again = await sdk.chat(ASK, session_id="async-1", max_tokens=6, temperature=0)
            assert "".join(parts) == first.content
            return again.content, again.cached_tokens

    content, cached = asyncio.run(run())
    assert content == whole.content and cached > 0


def _workflow(graph: AgentGraph, sdk: Overture, branch: str) -> None:
    """plan -> (code | test) -> review."""
    for agent in ("plan", branch, "review"):
        with graph.agent_sync(agent) as session:
            sdk.chat([{"role": "user", "content": f"{agent} step"}], session_id=session,
                     max_tokens=2, temperature=0)
    graph.finish_sync()


def test_an_agent_graph_advises_the_next_agents_and_invalidates_the_rest(
    cluster: Cluster,
) -> None:
    sdk = Overture(cluster.url, model=MODEL)
    graph = AgentGraph(sdk, lambda agent: f"wf-{agent}", MODEL)
    _workflow(graph, sdk, "code")  # profiling: both branches seen once
    _workflow(graph, sdk, "test")
    assert dict(graph.successors("plan")) == {"code": 0.5, "test": 0.5}
    assert graph.successors("review") == [] and graph.transitions["review"][END] == 2
    graph.advising = True
    sdk.events.clear()
    before = _followed(cluster)
    _workflow(graph, sdk, "code")
    kinds = [(e.kind, e.session_id) for e in sdk.events]
    # plan starts: nothing advised it (first agent); it advises code and test at once.
    assert kinds[:3] == [("request", "wf-plan"), ("advise", "wf-code"),
                         ("advise", "wf-test")] or kinds[:3] == [
        ("advise", "wf-code"), ("advise", "wf-test"), ("request", "wf-plan")]
    i_code = kinds.index(("request", "wf-code"))
    assert ("invalidate", "wf-test") in kinds[:i_code]  # the branch not taken
    assert kinds.index(("advise", "wf-code")) < i_code
    assert kinds.index(("advise", "wf-review")) < kinds.index(("request", "wf-review"))
    assert _followed(cluster) - before == 2  # code's and review's advisories were used


def test_the_langgraph_adapter_advises_what_the_graph_says(cluster: Cluster) -> None:
    from langgraph.graph import END as LG_END
    from langgraph.graph import START, StateGraph
    from overture_client.langgraph_adapter import LangGraphAdvisor, graph_successors

    sdk = Overture(cluster.url, model=MODEL)

    class State(TypedDict):
        log: Annotated[list[str], operator.add]

    def node(name: str):
        def call(state: State) -> dict:
            sdk.chat([{"role": "user", "content": name}], session_id=f"lg-{name}",
                     max_tokens=2, temperature=0)
            return {"log": [name]}
        return call

    builder = StateGraph(State)
    for name in ("plan", "code", "review"):
        builder.add_node(name, node(name))
    builder.add_edge(START, "plan")
    builder.add_conditional_edges("plan", lambda s: "code", ["code", "review"])
    builder.add_edge("code", "review")
    builder.add_edge("review", LG_END)
    app = builder.compile()
    assert graph_successors(app) == {"plan": ["code", "review"], "code": ["review"]}
    advisor = LangGraphAdvisor(sdk, app, lambda n: f"lg-{n}", MODEL)
    out = app.invoke({"log": []}, config={"callbacks": [advisor]})
    assert out["log"] == ["plan", "code", "review"]
    kinds = [(e.kind, e.session_id) for e in sdk.events]
    assert kinds.index(("advise", "lg-code")) < kinds.index(("request", "lg-code"))
    assert ("advise", "lg-review") in kinds[:kinds.index(("request", "lg-code"))]
    # plan advised code and review; code started: review's advisory from plan was kept
    # (code leads there too) until code advised it again; nothing is left pending.
    assert not advisor._pending
