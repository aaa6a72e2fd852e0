"""The simulator's engine cost model: how long a forward step and a KV transfer take.

The simulator calls the services' real policy and memory code but cannot run the model,
so the time a node spends is taken from a ``Calibration``: linear fits measured on the
real engine (``bench.sim.calibrate``) or figures given by hand for a GPU (the JSON files
next to this module; see README.md for where each number comes from).

A step of continuous batching computes prefill chunks and one token of every decoding
sequence together:

    step = max(prefill_base if any chunk, decode_base if any decode)
         + prefill_per_token * new + prefill_per_token_ctx * new * (context + new / 2)
         + decode_per_seq * decodes + decode_per_ctx_token * (context of the decodes)

A KV load from a tier costs ``load_overhead_s + bytes / bandwidth`` (a device hit is free).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

DEVICE, DRAM, PEER, S3 = "device", "dram", "peer", "s3"
TIERS = (DEVICE, DRAM, PEER, S3)


@dataclass(frozen=True)
class Calibration:
    name: str
    source: str  # how the figures were obtained
    # Compute (seconds): see the module docstring.
    prefill_base_s: float
    prefill_s_per_token: float
    prefill_s_per_token_ctx: float
    decode_base_s: float
    decode_s_per_seq: float
    decode_s_per_ctx_token: float
    # The model's KV and a node's memory.
    kv_bytes_per_token: int
    num_layers: int
    device_kv_bytes: int  # device memory for KV per node
    dram_bytes: int  # the node's kvstore DRAM tier
    # Transfers: bytes per second of each tier when loaded into a node's device memory.
    dram_bytes_per_s: float
    peer_bytes_per_s: float
    s3_bytes_per_s: float
    load_overhead_s: float  # fixed cost of one load (round trips)
    # The engine and the cluster around it.
    max_num_seqs: int = 64
    max_batched_tokens: int = 512
    request_overhead_s: float = 0.0  # routing, streaming: added to every request's TTFT
    heartbeat_s: float = 1.0
    # Granularity of the simulated block allocator: tokens per block, and how many groups
    # the layers are split into (a block holds one group's KV for its tokens).
    block_tokens: int = 16
    layer_groups: int = 1

    # -- compute ------------------------------------------------------------------------

    def step_s(self, chunks: list[tuple[int, int]], decodes: int, decode_ctx: int) -> float:
        """One engine step: prefill ``chunks`` of (new tokens, context before them) and
        ``decodes`` sequences decoding one token over ``decode_ctx`` context in all."""
        if not chunks and not decodes:
            return 0.0
        base = max(self.prefill_base_s if chunks else 0.0,
                   self.decode_base_s if decodes else 0.0)
        new = sum(n for n, _ in chunks)
        attn = sum(n * (c + n / 2) for n, c in chunks)
        return (base + self.prefill_s_per_token * new + self.prefill_s_per_token_ctx * attn
                + self.decode_s_per_seq * decodes + self.decode_s_per_ctx_token * decode_ctx)

    def prefill_s(self, new: int, context: int = 0) -> float:
        """Prefill of ``new`` tokens after ``context`` alone, in budget-sized steps."""
        total, done = 0.0, 0
        while done < new:
            n = min(self.max_batched_tokens, new - done)
            total += self.step_s([(n, context + done)], 0, 0)
            done += n
        return total

    # -- memory and transfers -------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        """Bytes of one simulated block: one layer group's KV of ``block_tokens``."""
        return self.kv_bytes_per_token * self.block_tokens // self.layer_groups

    @property
    def device_blocks(self) -> int:
        return max(1, self.device_kv_bytes // self.block_bytes)

    def bandwidth(self, tier: str) -> float:
        return {DRAM: self.dram_bytes_per_s, PEER: self.peer_bytes_per_s,
                S3: self.s3_bytes_per_s}[tier]

    def load_s(self, tier: str, nbytes: int) -> float:
        """Seconds to bring ``nbytes`` of KV from ``tier`` into device memory."""
        if tier == DEVICE or nbytes <= 0:
            return 0.0
        return self.load_overhead_s + nbytes / self.bandwidth(tier)

    # -- files ----------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        raw = json.loads(Path(path).read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{path}: unknown calibration fields {unknown}")
        return cls(**raw)
