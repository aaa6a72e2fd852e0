"""Engine configuration (section ``engine:``)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import ConfigError, opt


@dataclass(frozen=True)
class EngineConfig:
    host: str = opt("127.0.0.1", "address the Engine gRPC server binds to")
    port: int = opt(50053, "Engine gRPC port (0 = pick a free port)", min=0, max=65535)
    model_path: str = opt(
        "", "local Hugging Face model folder (config.json, *.safetensors, tokenizer.json)"
    )
    served_model_name: str = opt("", "name clients use for the model; default: the folder name")
    dtype: str = opt("bfloat16", "weights and KV dtype", choices=("bfloat16", "float16", "float32"))
    device: str = opt("cpu", "torch device; 'cuda' uses the CUDA seam", choices=("cpu", "cuda"))
    block_size: int = opt(16, "tokens per KV block (one layer per block)", min=1, max=1024)
    device_memory_bytes: int = opt(
        1 << 30, "device-memory budget for the KV pool (on CPU it stands in for HBM)", min=1 << 20
    )
    page_bytes: int = opt(2 << 20, "KV capacity grows and shrinks in pages of this size", min=4096)
    max_num_seqs: int = opt(64, "most sequences running in one step", min=1, max=4096)
    max_num_batched_tokens: int = opt(
        512, "token budget per step (prefill chunks + decodes)", min=1, max=1 << 20
    )
    max_model_len: int = opt(0, "context limit in tokens; 0 = the model's own", min=0)
    max_waiting: int = opt(1024, "queued requests before new ones are refused", min=1)
    num_threads: int = opt(0, "torch intra-op threads; 0 = torch default", min=0, max=1024)
    seed: int = opt(0, "global seed for requests that give none", min=0)
    debug_checks: bool = opt(False, "check KV allocator integrity after every step (slow)")

    def validate(self) -> None:
        if self.max_num_batched_tokens < self.block_size:
            raise ConfigError(
                "engine.max_num_batched_tokens: must be at least engine.block_size "
                f"({self.block_size}); raise it"
            )
