"""KV layout facts both the engine and the kvstore must agree on.

One block holds K and V of one layer for ``block_size`` tokens:

    block: (2, block_size, num_kv_heads, head_dim)  ->  2 * bs * heads * head_dim * itemsize bytes

A span is a run of a sequence's blocks served by one stored chunk: the kvstore's lookup
answers with spans (a ``StoredPrefix``), and the engine's load plan is made of the same
spans.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def block_bytes(block_size: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of one KV block: K and V of one layer for ``block_size`` tokens."""
    return 2 * block_size * num_kv_heads * head_dim * itemsize


@dataclass(frozen=True)
class KVSpan:
    """``use_blocks`` sequence blocks from ``first_block`` on, served by the chunk whose last
    block hash is ``chunk_hash`` (in every layer).

        blocks: | ... chunk c-1 ... |  chunk c: [start ........ start+bpc)  | ...
                                          ^first_block   ^first_block+use_blocks

    The chunk starts at ``first_block - first_block % blocks_per_chunk``; only the first span
    of a lookup whose ``first_block`` is mid-chunk starts after its chunk's start."""

    chunk_hash: bytes
    first_block: int
    use_blocks: int
    tier: str = ""  # slowest tier any layer of it sits in
    nbytes: int = 0  # payload bytes over all layers for use_blocks

    @property
    def end_block(self) -> int:
        return self.first_block + self.use_blocks


@dataclass
class StoredPrefix:
    """What a prefix lookup found: the prompt's first ``matched_blocks`` blocks are stored
    (beyond those the caller has), as ``spans`` held by lease ``lease_id`` until loaded or
    released ("" = nothing held), with each tier's measured load bandwidth."""

    matched_blocks: int
    spans: list[KVSpan] = field(default_factory=list)
    lease_id: str = ""
    tier_bytes_per_s: dict[str, float] = field(default_factory=dict)
    block_hashes: tuple[bytes, ...] = ()  # a whole-session lookup: the sequence it found
