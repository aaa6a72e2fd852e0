"""One budget for everything a request asks the model to read, checked before any node
tokenizes it or compiles a grammar for it: prompts, messages (their text, names and tool
calls), tools and their schemas, and the ``response_format`` schema.

Each part is measured as the fewest tokens it could become: token ids count as they are;
text as its characters over ``CHARS_PER_TOKEN_BOUND`` (no tokenizer packs more into one
token on average). A request whose parts add up to more than the model's context cannot
fit, and gets its 400 here, in microseconds, instead of after a node spent seconds and
gigabytes tokenizing megabytes of schema.
"""

from __future__ import annotations

import math

from services.scheduler.api.errors import invalid
from services.scheduler.api.request import ApiRequest, Prompt

CHARS_PER_TOKEN_BOUND = 32


def _prompt_parts(p: Prompt) -> tuple[int, int]:
    """(token ids, characters) of one prompt."""
    chars = len(p.text)
    for m in p.messages:
        chars += len(m.content) + len(m.name)
        chars += sum(len(c.name) + len(c.arguments) for c in m.tool_calls)
    return len(p.token_ids), chars


def fewest_tokens(req: ApiRequest, prompt: Prompt) -> int:
    """The fewest tokens ``prompt`` with ``req``'s tools and schema could take."""
    ids, chars = _prompt_parts(prompt)
    chars += len(req.guidance.tools_json) + len(req.guidance.json_schema)
    return ids + math.ceil(chars / CHARS_PER_TOKEN_BOUND)


def check_input_budget(req: ApiRequest, max_model_len: int) -> None:
    """400 (``context_length_exceeded``) for a request whose inputs cannot fit
    ``max_model_len`` tokens (0: not known yet, nothing to check); ``param`` names the
    largest part."""
    if max_model_len <= 0:
        return
    for p in req.prompts:
        least = fewest_tokens(req, p)
        if least > max_model_len:
            ids, chars = _prompt_parts(p)
            parts = {"messages" if p.kind == "chat" else "prompt": ids * CHARS_PER_TOKEN_BOUND
                     + chars, "tools": len(req.guidance.tools_json),
                     "response_format": len(req.guidance.json_schema)}
            raise invalid(
                f"the input (prompt, messages, tools and response_format schema) needs at "
                f"least {least} tokens, more than the model's context of {max_model_len} "
                "tokens holds", max(parts, key=lambda k: parts[k]),
                "context_length_exceeded")
