"""Chat messages and tools as the model's chat template wants them.

A template that takes ``tools`` (Hugging Face's convention: Qwen2, Llama 3.1, Mistral,
Hermes...) gets them as given, assistant ``tool_calls`` with their arguments as objects,
and ``tool`` messages with their ``tool_call_id``. A template that does not (SmolLM2's
ChatML, the demo model's) gets what it can render: the tools described in the system
message in the family's format (``ToolFormat.preamble``), an assistant's calls written
as the text the model would have generated, and tool results as user messages.
"""

from __future__ import annotations

from typing import Any

from ..api_types import ChatMessage, Guidance
from .formats import ToolFormat, _args_value


def takes_tools(template_source: str | None) -> bool:
    return bool(template_source) and "tools" in (template_source or "")


def template_messages(
    messages: tuple[ChatMessage, ...], guidance: Guidance, fmt: ToolFormat, native: bool
) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """(messages, tools) for ``ChatTemplate.render``."""
    if native:
        return [_native(m) for m in messages], (list(guidance.tools) or None)
    out = [_fallback(m, fmt) for m in messages]
    # (also with tool_choice "none": the prompt of every turn of a conversation then starts
    # the same way, and its KV is reused)
    if guidance.tools:
        preamble = fmt.preamble(guidance.tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out, None


def _native(m: ChatMessage) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        d["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": _args_value(c.arguments)}}
            for c in m.tool_calls
        ]
    if m.role == "tool":
        d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
    return d


def _fallback(m: ChatMessage, fmt: ToolFormat) -> dict[str, Any]:
    if m.tool_calls:
        calls = fmt.call_text(m.tool_calls)
        return {"role": "assistant", "content": f"{m.content}{calls}" if m.content else calls}
    if m.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"}
    return {"role": m.role, "content": m.content}
