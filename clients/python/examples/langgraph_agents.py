"""A LangGraph agent graph whose nodes' KV is moved into place before they run.

    overture up --nodes 2            # in another terminal
    python clients/python/examples/langgraph_agents.py [--url http://127.0.0.1:8000]

planner -> coder -> reviewer, and back to the coder until the reviewer approves (at most
three rounds). ``LangGraphAdvisor`` is a LangChain callback: when a node starts, it
advises every node the graph's edges lead to from it, and invalidates the branches not
taken. Each node is an agent with its own session. It prints what it advised and when.
"""

from __future__ import annotations

import argparse
import operator
import time
import uuid
from typing import Annotated, TypedDict

from langgraph.graph import END, START, StateGraph
from overture_client import Overture
from overture_client.langgraph_adapter import LangGraphAdvisor

ROLES = {"planner": "Plan the work in three bullet points.",
         "coder": "Write the code for the plan, or fix it after the review.",
         "reviewer": "Review the code. Answer APPROVED if it is good."}


class State(TypedDict):
    task: str
    notes: Annotated[list[str], operator.add]
    rounds: int


def build(client: Overture, run: str, max_tokens: int) -> object:
    def agent(name: str):
        def node(state: State) -> dict:
            history = [{"role": "system", "content": ROLES[name]},
                       {"role": "user", "content": state["task"]},
                       *({"role": "user", "content": n} for n in state["notes"][-2:])]
            answer = client.chat(history, session_id=f"{run}-{name}", max_tokens=max_tokens,
                                 temperature=0)
            return {"notes": [f"{name}: {answer.content}"],
                    "rounds": state["rounds"] + (name == "reviewer")}
        return node

    g = StateGraph(State)
    for name in ROLES:
        g.add_node(name, agent(name))
    g.add_edge(START, "planner")
    g.add_edge("planner", "coder")
    g.add_edge("coder", "reviewer")
    g.add_conditional_edges(
        "reviewer",
        lambda s: END if "APPROVED" in s["notes"][-1] or s["rounds"] >= 3 else "coder",
        ["coder", END])
    return g.compile()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    with Overture(args.url, args.api_key) as client:
        r = client.http.get(args.url + "/v1/models", headers=client.headers())
        client.model = r.json()["data"][0]["id"]
        run = uuid.uuid4().hex[:8]
        app = build(client, run, args.max_tokens)
        advisor = LangGraphAdvisor(client, app, lambda node: f"{run}-{node}", client.model)
        t0 = time.monotonic()
        app.invoke({"task": "A function that reverses the words of a sentence.", "notes": [],
                    "rounds": 0}, config={"callbacks": [advisor]})
        for e in client.events:
            print(f"{e.at - t0:7.2f}s  {e.kind:10} {e.session_id.split('-', 1)[1]}")


if __name__ == "__main__":
    main()
