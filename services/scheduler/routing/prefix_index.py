"""Which node holds which prompt prefixes in device memory: the index behind the ``prefix``
baseline policy (precise prefix-aware routing as llm-d's KV-cache-aware router does it,
a baseline users pick today).

A prompt is cut into blocks and hashed as a chain, ``h_i = H(h_{i-1}, block i)``, so one
hash names a whole prefix (DESIGN §2's content hashes, over the prompt as the scheduler
sees it: the scheduler has no tokenizer, so a block is ``BLOCK_CHARS`` characters of the
rendered messages, not 16 tokens). Each node has an LRU of the block hashes its device
holds:

- a turn served on a node adds its prompt's blocks there (the engine keeps the KV of a
  finished turn on device as evictable cache);
- a node holds at most ``capacity_blocks`` (the device's size, in the index's blocks):
  the least recently used go first, as the engine's prefix cache evicts them;
- a turn routed for a match of k blocks that reports no cached tokens tells the index
  the node's device dropped them (a KV event, learned late): they are forgotten there.

    prompt  [ b0 | b1 | b2 | b3 | b4 ]     hashes h0 → h1 → h2 → h3 → h4
    node A  {h0 h1 h2}           match(A) = 3 leading blocks
    node B  {h0 h1 h2 h3}        match(B) = 4  ← the prefix policy routes here
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable

from shared.proto import common_pb2

BLOCK_CHARS = 64  # characters per block: about 16 tokens of English text


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


class PrefixIndex:
    """Per-node LRU sets of block hashes. Not thread-safe: the scheduler's event loop owns
    it (the ``Dispatcher`` updates it as turns end)."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be ≥ 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._nodes: dict[str, OrderedDict[bytes, None]] = {}

    def match(self, node_id: str, hashes: tuple[bytes, ...]) -> int:
        """How many leading blocks of ``hashes`` the node holds (the chain makes block i
        worthless without blocks 0..i-1, so the count stops at the first gap)."""
        held = self._nodes.get(node_id)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def matches(self, node_ids: Iterable[str], hashes: tuple[bytes, ...]) -> dict[str, int]:
        """``match`` of every node that holds at least one block."""
        return {n: k for n in node_ids if (k := self.match(n, hashes)) > 0}

    def served(self, node_id: str, hashes: tuple[bytes, ...]) -> None:
        """A turn with this prompt ended on ``node_id``: its blocks are there, most
        recently used; the least recently used beyond the capacity go."""
        held = self._nodes.setdefault(node_id, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)

    def evicted(self, node_id: str, hashes: tuple[bytes, ...]) -> None:
        """The node reused none of these blocks: its device no longer holds them."""
        held = self._nodes.get(node_id)
        if held:
            for h in hashes:
                held.pop(h, None)

    def forget_node(self, node_id: str) -> None:
        """A node that left (or restarted) holds nothing."""
        self._nodes.pop(node_id, None)

    def size(self, node_id: str) -> int:
        return len(self._nodes.get(node_id, ()))
