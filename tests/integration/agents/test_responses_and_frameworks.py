"""The Responses API and two agent frameworks, unchanged, against a real cluster serving
the random-weight demo model (tool calls are forced where a step must call one)."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import openai
import pytest
from pydantic import Field

from tests.cluster import Cluster

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather now.",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False},
           "strict": True}

Small = Annotated[int, Field(ge=0, le=99)]  # (a random model writes long numbers otherwise)


def test_a_previous_response_chain_reuses_its_kv(client: openai.OpenAI,
                                                 cluster: Cluster) -> None:
    first = client.responses.create(model="demo-tiny", input="Where is Paris?",
                                    instructions="Answer briefly.", max_output_tokens=12,
                                    temperature=0)
    assert first.status in ("completed", "incomplete") and first.output_text
    second = client.responses.create(model="demo-tiny", input="And Rome?",
                                     instructions="Answer briefly.", max_output_tokens=12,
                                     previous_response_id=first.id, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0, cluster.logs()
    assert client.responses.retrieve(second.id).id == second.id
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="demo-tiny", input="x", previous_response_id="resp_no")


def test_function_call_items_round_trip(client: openai.OpenAI) -> None:
    r = client.responses.create(model="demo-tiny", input="Weather in Oslo?", tools=[WEATHER],
                                tool_choice="required", temperature=1.0, max_output_tokens=120)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and r.status == "completed"
    assert len(json.loads(calls[0].arguments)["city"]) <= 12
    follow = client.responses.create(
        model="demo-tiny", previous_response_id=r.id, tools=[WEATHER], max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "sunny"}], temperature=0)
    assert follow.usage.input_tokens_details.cached_tokens > 0
    assert [o.type for o in follow.output] == ["message"]


def test_streamed_events_build_the_same_response(client: openai.OpenAI) -> None:
    kinds: list[str] = []
    text = []
    final = None
    with client.responses.stream(model="demo-tiny", input="Hello there", temperature=0,
                                 max_output_tokens=10) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text.append(event.delta)
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response  # (10 tokens may cut it short: "incomplete")
    assert final is not None and kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(text) == final.output_text
    whole = client.responses.create(model="demo-tiny", input="Hello there", temperature=0,
                                    max_output_tokens=10)
    assert whole.output_text == final.output_text
    calls = []
    with client.responses.stream(model="demo-tiny", input="Weather?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=120) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.done":
                calls.append(json.loads(event.arguments))
        final = stream.get_final_response()  # ("completed": the call ended the output)
    assert len(calls) == 1 and final.output[-1].type == "function_call"


def test_openai_agents_sdk_runs_a_tool_step(cluster: Cluster) -> None:
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel
    from pydantic import BaseModel

    class Report(BaseModel):  # the final answer, as structured output (a bounded schema)
        sunny: bool

    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"It is sunny in {city}."

    model = OpenAIResponsesModel(
        model="demo-tiny",
        openai_client=openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused"))
    # The SDK sets tool_choice back to "auto" after the first call (reset_tool_choice), so
    # the second step answers: with the Report schema enforced.
    agent = Agent(name="weather", instructions="Use the tool, then answer.", model=model,
                  tools=[get_weather], output_type=Report,
                  model_settings=ModelSettings(tool_choice="required", max_tokens=200,
                                               temperature=0.7))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert seen, "the agent never called its tool"
    assert isinstance(result.final_output, Report)


@pytest.mark.slow
def test_langgraph_prebuilt_agent_runs_a_tool_step(cluster: Cluster) -> None:
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    seen: list[int] = []

    @tool
    def add(a: Small, b: Small) -> int:
        """Add two integers."""
        seen.append(a + b)
        return a + b

    llm = ChatOpenAI(model="demo-tiny", base_url=cluster.url + "/v1", api_key="unused",
                     temperature=0.7, max_tokens=200)
    forced = llm.bind_tools([add], tool_choice="add")
    free = llm.bind_tools([add], tool_choice="none")

    def pick(state: dict, runtime: object) -> object:
        """Call the tool first; once its result is in, answer."""
        done = any(isinstance(m, ToolMessage) for m in state["messages"])
        return free if done else forced

    agent = create_react_agent(pick, [add])
    out = agent.invoke({"messages": [("user", "What is 2 + 3?")]}, {"recursion_limit": 8})
    kinds = [m.type for m in out["messages"]]
    assert kinds == ["human", "ai", "tool", "ai"], [repr(m)[:800] for m in out["messages"]]
    assert seen and out["messages"][2].content == str(seen[0])
