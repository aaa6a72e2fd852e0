"""Tensor fingerprints (Tangram §3.1: "a unique fingerprint as the index for every
tensor") and a model's index: its engine tensors, each with its fingerprint and size.

A fingerprint names the bytes an engine computes with: XXH3-128 over the serving dtype,
the shape, and for each checkpoint part its dtype and an XXH3-128 of its raw bytes. The
engine tensor's bytes are a function of exactly these (concatenation, then conversion),
so equal fingerprints mean equal bytes (up to a 128-bit collision), whichever model or
file they came from: a layer two fine-tunes left frozen is one tensor. Hashing reads the
checkpoint once (the file mapping, no copy, ~GB/s); the index is then kept, and an
activation whose tensors are all resident reads no weight byte at all.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from shared.weight_layout import EngineTensor, engine_tensors


@dataclass(frozen=True)
class TensorSpec:
    name: str  # the engine's name for it
    key: str  # fingerprint
    nbytes: int


@dataclass(frozen=True)
class ModelIndex:
    model: str
    path: str
    dtype: str
    tensors: tuple[TensorSpec, ...]
    stamp: tuple[tuple[str, int, int], ...]  # (file, size, mtime_ns): when to rehash

    def unique(self) -> dict[str, int]:
        """Fingerprint -> bytes, each distinct tensor once."""
        return {t.key: t.nbytes for t in self.tensors}

    @property
    def total_bytes(self) -> int:
        return sum(self.unique().values())


def weight_stamp(folder: Path) -> tuple[tuple[str, int, int], ...]:
    out = []
    for f in sorted(folder.glob("*.safetensors")):
        st = f.stat()
        out.append((f.name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def index_model(model: str, folder: str | Path, dtype: str) -> ModelIndex:
    """Fingerprint every engine tensor of the model folder (blocking: reads the weights)."""
    root = Path(folder)
    cfg = json.loads((root / "config.json").read_text())
    where: dict[str, tuple[Path, dict[str, Any], int]] = {}  # name -> (file, entry, data start)
    for f in sorted(root.glob("*.safetensors")):
        header, n = _header(f)
        for name, meta in header.items():
            if name != "__metadata__":
                where[name] = (f, meta, 8 + n)
    layout = engine_tensors({n: m["shape"] for n, (_, m, _) in where.items()},
                            int(cfg["num_hidden_layers"]),
                            bool(cfg.get("tie_word_embeddings", False)))
    maps: dict[Path, mmap.mmap] = {}
    try:
        specs = tuple(_spec(t, where, maps, dtype) for t in layout)
    finally:
        for m in maps.values():
            m.close()
    return ModelIndex(model, str(folder), dtype, specs, weight_stamp(root))


_Where = dict[str, tuple[Path, dict[str, Any], int]]  # name -> (file, entry, data start)


def _spec(t: EngineTensor, where: _Where, maps: dict[Path, mmap.mmap], dtype: str
          ) -> TensorSpec:
    h = xxhash.xxh3_128()
    h.update(f"{dtype}|{t.shape}".encode())
    for part in t.parts:
        path, meta, start = where[part]
        if path not in maps:
            with path.open("rb") as fh:
                maps[path] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        begin, end = meta["data_offsets"]
        view = memoryview(maps[path])[start + begin:start + end]
        try:
            h.update(f"|{meta['dtype']}:".encode() + xxhash.xxh3_128_digest(view))
        finally:
            view.release()
    return TensorSpec(t.name, h.hexdigest(), t.nbytes(dtype))


def _header(path: Path) -> tuple[dict[str, Any], int]:
    with path.open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n)), n
