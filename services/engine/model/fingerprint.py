"""Model fingerprint (DESIGN §2): KV made by one model is never used with another.

sha256 over the canonical config.json, the hash of tokenizer.json, each weights file's
name, size and header bytes (the header holds every tensor's dtype, shape and offsets, so
any re-export changes it), and the KV dtype. Cheap: no weight bytes are read.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from .safetensors_files import SafetensorsFile


def model_fingerprint(
    config_raw: dict[str, Any],
    tokenizer_path: Path,
    weights: list[SafetensorsFile],
    kv_dtype: torch.dtype,
    quant: str = "",
) -> str:
    h = hashlib.sha256()
    h.update(b"overture-model-fp-v1\0")
    canon = json.dumps(config_raw, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    h.update(canon.encode() + b"\0")
    h.update(hashlib.sha256(tokenizer_path.read_bytes()).digest())
    for f in sorted(weights, key=lambda w: w.path.name):
        h.update(f"{f.path.name}\0{f.size}\0".encode())
        h.update(hashlib.sha256(f.header_bytes).digest())
    h.update(str(kv_dtype).encode())
    if quant:  # (absent for float models: their fingerprints stay what they were)
        h.update(f"\0quant={quant}".encode())
    return h.hexdigest()
