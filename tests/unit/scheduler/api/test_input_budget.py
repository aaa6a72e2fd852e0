"""Issue 43, finding 5: tools, tool schemas, the response_format schema and messages count
against one budget, checked before any node tokenizes or compiles a grammar."""

from __future__ import annotations

import json
from contextlib import AsyncExitStack

import pytest

from services.scheduler.api import ApiError, Limits, check_input_budget, validate
from tests.unit.scheduler.conftest import call, make_cluster

HI = [{"role": "user", "content": "hi"}]


def big_tool(nbytes: int) -> dict:
    props = {f"p{i}": {"type": "string", "description": "x" * 200} for i in range(nbytes // 240)}
    return {"type": "function",
            "function": {"name": "big", "parameters": {"type": "object", "properties": props}}}


def _chat(**body: object) -> dict:
    return {"model": "demo", "messages": HI, "max_tokens": 2, **body}


@pytest.mark.parametrize("body, param", [
    (_chat(tools=[big_tool(40_000)]), "tools"),
    (_chat(response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": big_tool(40_000)["function"]["parameters"]}}),
     "response_format"),
    (_chat(messages=[{"role": "user", "content": "x" * 40_000}]), "messages"),
    (_chat(messages=[*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function",
         "function": {"name": "f", "arguments": "1" * 40_000}}]}]), "messages"),
])
def test_each_part_counts_against_the_context(body: dict, param: str) -> None:
    req = validate(body, "chat", Limits())
    check_input_budget(req, max_model_len=2000)  # 64,000 characters could fit
    with pytest.raises(ApiError) as e:
        check_input_budget(req, max_model_len=1000)  # 32,000 cannot
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    assert e.value.param == param


def test_parts_add_up() -> None:
    # Neither part alone is over the budget, together they are.
    body = _chat(messages=[{"role": "user", "content": "x" * 20_000}],
                 tools=[big_tool(20_000)])
    with pytest.raises(ApiError, match="needs at least"):
        check_input_budget(validate(body, "chat", Limits()), max_model_len=1000)
    check_input_budget(validate(body, "chat", Limits()), max_model_len=0)  # (not known yet)


async def test_a_4mb_tool_schema_gets_its_400_before_any_node_sees_it() -> None:
    async with AsyncExitStack() as stack:
        c = await make_cluster(stack)
        body = _chat(tools=[big_tool(4_000_000)])
        assert len(json.dumps(body)) > 3_900_000
        status, err, _ = await call(c, "POST", "/v1/chat/completions", body)
        assert status == 400, err
        assert err["error"]["code"] == "context_length_exceeded"
        assert err["error"]["param"] == "tools"
        assert c.engine.requests == []  # refused by the budget: no engine tokenized it
        status, _, _ = await call(c, "POST", "/v1/chat/completions", _chat())
        assert status == 200 and len(c.engine.requests) == 1
