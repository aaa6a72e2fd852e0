"""A request's tools and output constraints, made concrete for one model.

    ModelGuidance (one per loaded model)
      .prompt_ids(req)      the chat rendered with its tools (tools/prompt.py)
      .constraint(req)      the grammar its output must follow, or None (structured/)
      .output_stream(req)   the parser that lifts tool calls out of its output (tools/)

What is enforced: ``response_format`` json_object / json_schema (strict or not: a schema
given is a schema kept), ``tool_choice`` "required" (one or more calls of the declared
functions, one when ``parallel_tool_calls`` is false) and a named function (exactly one
call of it). "auto" is not constrained (the model may answer in text); its calls are
parsed out of the text, and text that is not a valid call stays content.
"""

from __future__ import annotations

from .api_types import GenerateRequest, Guidance
from .errors import INVALID_ARGUMENT, EngineError
from .model.tokenizer import Tokenizer
from .structured import Constraint, GrammarCompiler
from .tools import ToolCallStream, ToolFormat, detect, takes_tools, template_messages
from .tools.formats import tool_names


class ModelGuidance:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: tuple[int, ...],
                 tool_parser: str = "") -> None:
        self._tok = tokenizer
        self.format: ToolFormat = detect(tokenizer.template_source, tool_parser)
        self.native_tools = takes_tools(tokenizer.template_source)
        self._compiler = GrammarCompiler(tokenizer.to_json(), vocab_size, eos_ids)

    def prompt_ids(self, req: GenerateRequest) -> list[int]:
        assert req.messages is not None
        msgs, tools = template_messages(req.messages, req.guidance, self.format,
                                        self.native_tools)
        return self._tok.encode_chat(msgs, req.add_generation_prompt, tools)

    def constraint(self, g: Guidance) -> Constraint | None:
        if g.tools and g.tool_choice not in ("none", "auto"):
            return self._tool_constraint(g)
        if g.response_format == "json_object":
            return self._compiler.json_schema({"type": "object"}, "response_format")
        if g.response_format == "json_schema":
            return self._compiler.json_schema(g.json_schema or {}, "response_format.json_schema")
        return None

    def _tool_constraint(self, g: Guidance) -> Constraint:
        tools = g.tools
        parallel = g.parallel_tool_calls
        if g.tool_choice.startswith("function:"):
            name = g.tool_choice.removeprefix("function:")
            tools = tuple(t for t in g.tools if t["function"]["name"] == name)
            if not tools:
                raise EngineError(INVALID_ARGUMENT,
                                  f"tool_choice names {name!r}, which is not among the tools")
            parallel = False
        elif g.tool_choice != "required":
            raise EngineError(INVALID_ARGUMENT, f"unknown tool_choice {g.tool_choice!r}")
        f = self.format
        marker = self._compiler.special_token(f.start, self._tok.token_id(f.start))
        return self._compiler.lark(f.grammar(tools, parallel=parallel, marker=marker),
                                   "tool_choice")

    def output_stream(self, g: Guidance) -> ToolCallStream | None:
        if not g.parses_tool_calls:
            return None
        return ToolCallStream(self.format, tool_names(g.tools), g.parallel_tool_calls)
