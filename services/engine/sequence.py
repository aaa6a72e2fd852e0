"""A request inside the engine: counters, not phases (vLLM v1).

    token_ids:  | prompt ............................. | output ........ |
                |<-------- num_computed_tokens -------->|<- to compute ->|
                                                         num_tokens = len(token_ids)

Prefill, chunked prefill, decode, prefix hits and recompute after preemption are all
"compute tokens [num_computed_tokens, num_tokens)"; invariant:
``0 <= num_computed_tokens <= num_tokens`` and every layer's block table covers the
computed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from shared.session_key import SessionKey

from .api_types import SamplingParams
from .offload_state import OffloadState


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    hash_seed: bytes  # model fingerprint + tenant (shared/hashing.py)
    max_total_tokens: int  # prompt + most output tokens (max_tokens or the context limit)
    arrival: int  # FCFS order
    num_layers: int
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prompt tokens reused at first admission
    block_tables: list[list[int]] = field(default_factory=list)  # [layer][block index]
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks of token_ids
    num_registered_blocks: int = 0  # leading blocks already entered in the prefix cache
    num_preemptions: int = 0
    status: Status = Status.WAITING
    no_reuse: bool = False  # reuses no stored or cached KV and saves none (a baseline)
    device_only: bool = False  # reuses only the device cache; saves nothing (a baseline)
    overtaken: int = 0  # times a higher-priority arrival was queued ahead of it
    waiting_since: float = 0.0  # time.monotonic() it last entered the waiting queue
    priority: int = 0
    tenant: str = ""
    session_id: str = ""
    offload: OffloadState = field(default_factory=OffloadState)  # stored KV (offload/)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if not self.block_tables:
            self.block_tables = [[] for _ in range(self.num_layers)]

    @property
    def session(self) -> SessionKey:
        return SessionKey(self.tenant, self.session_id)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_blocks(self) -> int:
        """Blocks per layer currently held (every layer holds the same number)."""
        return len(self.block_tables[0]) if self.block_tables else 0

    def check(self) -> None:
        assert 0 <= self.num_computed_tokens <= self.num_tokens, "counters out of range"
        assert len({len(t) for t in self.block_tables}) <= 1, "layers hold different counts"
