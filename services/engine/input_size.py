"""A request's input measured before any work is spent on it: the prompt, the messages
(with their names and tool calls), the tools and the response schema, all counted
against one budget, the context.

Tokenizing or compiling a grammar costs time and memory in proportion to the input, so
an input that cannot fit the context is refused before either runs. Token ids count as
they are; text as its characters over ``CHARS_PER_TOKEN_BOUND`` (no tokenizer packs more
into one token on average), the fewest tokens it could become: the engine never
tokenizes more than that many characters per token of context. The same parts at
``CHARS_PER_TOKEN`` are the prompt length admission assumes before tokenizing.
"""

from __future__ import annotations

import json
import math

from .api_types import GenerateRequest
from .errors import INVALID_ARGUMENT, EngineError

CHARS_PER_TOKEN_BOUND = 32  # no tokenizer averages more characters per token
CHARS_PER_TOKEN = 4.0  # a typical average: a prompt's tokens estimated from its text


def input_parts(req: GenerateRequest) -> tuple[int, int]:
    """(token ids, characters of text) of everything the model would read."""
    chars = len(req.prompt or "")
    for m in req.messages or ():
        chars += len(m.content) + len(m.name)
        chars += sum(len(c.name) + len(c.arguments) for c in m.tool_calls)
    g = req.guidance
    if g.tools:
        chars += len(json.dumps(g.tools))
    if g.json_schema is not None:
        chars += len(json.dumps(g.json_schema))
    return len(req.prompt_token_ids or ()), chars


def estimate_tokens(parts: tuple[int, int]) -> int:
    """A prompt's length in tokens before tokenizing, from its ``input_parts``."""
    ids, chars = parts
    return max(1, ids + int(chars / CHARS_PER_TOKEN))


def check_input_size(req: GenerateRequest, max_model_len: int) -> tuple[int, int]:
    """INVALID_ARGUMENT for an input that cannot fit ``max_model_len`` tokens, before it
    is tokenized or its grammar compiled; else its ``input_parts``."""
    ids, chars = parts = input_parts(req)
    least = ids + math.ceil(chars / CHARS_PER_TOKEN_BOUND)
    if least > max_model_len:
        raise EngineError(
            INVALID_ARGUMENT,
            f"the input (prompt, messages, tools and response schema) needs at least "
            f"{least} tokens, more than the context limit of {max_model_len} tokens")
    return parts
