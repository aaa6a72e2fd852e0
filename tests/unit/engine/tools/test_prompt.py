"""Tools and tool messages rendered for templates that take them and templates that do not;
the rendered prompt of one agent turn is a prefix of the next turn's."""

from __future__ import annotations

import json

from services.engine.api_types import ChatMessage, Guidance, ToolCall
from services.engine.model.chat_template import ChatTemplate
from services.engine.model.demo_model import CHAT_TEMPLATE
from services.engine.tools import FORMATS, takes_tools, template_messages

TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer"}}}}}
# A small template in the style of Qwen2's: tools in the system turn, calls as <tool_call>.
NATIVE = (
    "{% if tools %}<|system|>{% for t in tools %}{{ t.function.name }};{% endfor %}\n"
    "{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
    "{% if m.role == 'tool' %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CALL = ToolCall("call_1", "get_time", '{"zone": 2}')
TURN1 = (ChatMessage("user", "time?"),)
TURN2 = (*TURN1, ChatMessage("assistant", "", (CALL,)),
         ChatMessage("tool", "12:00", tool_call_id="call_1"))


def render(template: str, msgs: tuple[ChatMessage, ...], guidance: Guidance,
           generation: bool = True) -> str:
    native = takes_tools(template)
    m, tools = template_messages(msgs, guidance, FORMATS["hermes"], native)
    return ChatTemplate(template, "<s>", "</s>").render(m, generation, tools)


def test_a_template_that_takes_tools_renders_them() -> None:
    g = Guidance(tools=(TOOL,))
    out = render(NATIVE, TURN2, g)
    assert out.startswith("<|system|>get_time;")
    assert '<tool_call>get_time {"zone": 2}</tool_call>' in out  # arguments as an object
    assert "<|tool|>12:00[call_1]" in out


def test_a_template_without_tools_gets_them_in_the_system_turn() -> None:
    g = Guidance(tools=(TOOL,))
    out = render(CHAT_TEMPLATE, TURN2, g)
    system = out.split("<|eot_id|>")[0]
    assert "<tools>" in system and json.dumps(TOOL["function"]["name"]) in system
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call>' in out
    assert "<tool_response>\n12:00\n</tool_response>" in out


def test_each_agent_turn_extends_the_previous_prompt() -> None:
    """Turn 1's prompt + the call it generated is the start of turn 2's prompt (KV reuse),
    whatever tool_choice each turn uses."""
    for template in (CHAT_TEMPLATE, NATIVE):
        first = render(template, TURN1, Guidance(tools=(TOOL,), tool_choice="required"))
        second = render(template, TURN2, Guidance(tools=(TOOL,), tool_choice="none"))
        assert second.startswith(first), template[:20]
