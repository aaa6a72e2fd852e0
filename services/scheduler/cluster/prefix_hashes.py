"""How the scheduler names a prompt's leading context: chains of hashes, two granularities.

The scheduler does not tokenize, so it cannot hash the engine's 16-token blocks; it hashes
what it sees, as a chain (``h_i = H(h_{i-1}, part i)``, DESIGN §2's content hashes), so
that one hash names a whole prefix and tenants and models never share one:

- ``prompt_prefix``: one hash per leading *message* (the last, the turn's new input, left
  out): the key of a new session's locality (a shared system prompt, tool definitions);
- ``request_hashes``: one hash per ``BLOCK_CHARS`` characters of the rendered prompt: the
  key of the ``prefix`` baseline's device index (precise prefix-aware routing, as llm-d's
  KV-cache-aware router does it).

Both feed one ``PrefixIndex`` (``prefixes.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from shared.proto import common_pb2

LEADING_MESSAGES = 8  # hashed at most: shared context sits at the start of a chat
BLOCK_CHARS = 64  # characters per block: about 16 tokens of English text


def prompt_prefix(tenant: str, model: str, tools_json: str,
                  messages: Sequence[tuple[str, str]]) -> tuple[str, ...]:
    """The chain of hashes of a chat's leading context ((role, content) pairs; the last
    message, the turn's new input, is left out). Empty for a prompt of one message::

        h0 = H(tenant, model, tools)   h1 = H(h0, message 0)   h2 = H(h1, message 1) ...
    """
    if len(messages) < 2:
        return ()
    h = hashlib.blake2b(f"{tenant}\0{model}\0{tools_json}".encode(), digest_size=16)
    out = []
    for role, content in messages[:-1][:LEADING_MESSAGES]:
        h = hashlib.blake2b(h.digest() + f"{role}\0{content}".encode(), digest_size=16)
        out.append(h.hexdigest())
    return tuple(out)


def prompt_text(parts: Iterable[tuple[str, str]]) -> str:
    """The rendering that is hashed: each (role, content) with separators no content has
    (a role cannot leak into the next message's text and make two prompts alike)."""
    return "".join(f"\x1e{role}\x1f{content}" for role, content in parts)


def request_hashes(request: common_pb2.GenerateRequest) -> tuple[bytes, ...]:
    """The block hashes of a generation's prompt, seeded by its model and tenant."""
    kinds = common_pb2.GenerateRequest
    if request.input_kind == kinds.CHAT:
        text = prompt_text(
            (m.role, m.content + "".join(f"\x1d{c.name}{c.arguments}" for c in m.tool_calls))
            for m in request.messages)
    elif request.input_kind == kinds.TOKEN_IDS:
        text = prompt_text(("", f"{t:x} ") for t in request.prompt_token_ids)
    else:
        text = request.prompt
    return block_hashes(text, f"{request.model}\x1f{request.tenant}")


def block_hashes(text: str, seed: str = "") -> tuple[bytes, ...]:
    """Chained hashes of ``text``'s full blocks (a partial last block is not cached by an
    engine either). ``seed`` separates models and tenants."""
    out: list[bytes] = []
    prev = hashlib.blake2b(seed.encode(), digest_size=16).digest()
    full = len(text) // BLOCK_CHARS
    for i in range(full):
        block = text[i * BLOCK_CHARS:(i + 1) * BLOCK_CHARS].encode()
        prev = hashlib.blake2b(prev + block, digest_size=16).digest()
        out.append(prev)
    return tuple(out)
