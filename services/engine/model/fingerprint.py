"""Model fingerprint (DESIGN §2): KV made by one model is never used with another.

sha256 over the canonical config.json, the hash of tokenizer.json, each weights file's
name, size and header bytes (the header holds every tensor's dtype, shape and offsets, so
any re-export changes it), a sample of every tensor's bytes (its first and last 64), and
the KV dtype. The sample is what tells two fine-tunes of one base apart: their configs,
tokenizers and headers are byte for byte the same, and without it they would share KV
(training changes every element of a tensor it touches, so its first bytes). Cheap: two
small reads per tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
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
    h.update(b"overture-model-fp-v2\0")
    canon = json.dumps(config_raw, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    h.update(canon.encode() + b"\0")
    h.update(hashlib.sha256(tokenizer_path.read_bytes()).digest())
    for f in sorted(weights, key=lambda w: w.path.name):
        h.update(f"{f.path.name}\0{f.size}\0".encode())
        h.update(hashlib.sha256(f.header_bytes).digest())
        h.update(_sample(f))
    h.update(str(kv_dtype).encode())
    if quant:  # (absent for float models: their fingerprints stay what they were)
        h.update(f"\0quant={quant}".encode())
    return h.hexdigest()


SAMPLE = 64


def _sample(f: SafetensorsFile) -> bytes:
    """A digest of each tensor's first and last ``SAMPLE`` bytes, in file order."""
    h = hashlib.sha256()
    fd = os.open(f.path, os.O_RDONLY)
    try:
        for info in sorted(f.tensors.values(), key=lambda t: t.begin):
            h.update(os.pread(fd, min(SAMPLE, info.end - info.begin), info.begin))
            tail = max(info.begin, info.end - SAMPLE)
            h.update(os.pread(fd, info.end - tail, tail))
    finally:
        os.close(fd)
    return h.digest()
