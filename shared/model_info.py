"""The one description of a served model that engine, nodemgr and scheduler pass around."""

from __future__ import annotations

from dataclasses import dataclass

from shared.proto import common_pb2


@dataclass(frozen=True)
class ModelInfo:
    name: str
    fingerprint: str = ""  # DESIGN §2: config, tokenizer, weights identity, KV dtype
    max_model_len: int = 0
    dtype: str = ""
    num_layers: int = 0
    block_size: int = 0
    max_num_seqs: int = 0  # seats: sequences run at once (0: not said)

    def to_proto(self) -> common_pb2.ModelInfo:
        return common_pb2.ModelInfo(
            name=self.name,
            fingerprint=self.fingerprint,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
            num_layers=self.num_layers,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
        )

    @classmethod
    def from_proto(cls, m: common_pb2.ModelInfo) -> ModelInfo:
        return cls(m.name, m.fingerprint, m.max_model_len, m.dtype, m.num_layers, m.block_size,
                   m.max_num_seqs)
