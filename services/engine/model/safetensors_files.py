"""Reading *.safetensors files: headers for validation and fingerprints, tensors by mmap.

    file: | u64 little-endian N | N bytes JSON header | data ... |
    header: {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}

Tensors are views into one copy-on-write mapping of each file (UntypedStorage.from_file),
so nothing is read until used and nothing is copied when the dtype already matches.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared.libc import drop_mapped_pages

from .errors import LoaderError

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offset from the start of the file
    end: int


@dataclass
class SafetensorsFile:
    path: Path
    size: int
    header_bytes: bytes
    tensors: dict[str, TensorInfo]
    _storage: torch.UntypedStorage | None = field(default=None, repr=False)

    def tensor(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        dtype = DTYPES.get(info.dtype)
        if dtype is None:
            raise LoaderError(f"{self.path}: tensor {name!r} has unsupported dtype {info.dtype}")
        itemsize = torch.empty(0, dtype=dtype).element_size()
        numel = 1
        for d in info.shape:
            numel *= d
        if info.end - info.begin != numel * itemsize:
            raise LoaderError(
                f"{self.path}: tensor {name!r} spans {info.end - info.begin} bytes, "
                f"expected {numel * itemsize} for shape {list(info.shape)} {info.dtype}"
            )
        if info.begin % itemsize:
            # Unaligned data cannot be viewed in place; read it (rare, non-standard writers).
            with open(self.path, "rb") as f:
                f.seek(info.begin)
                raw = bytearray(f.read(info.end - info.begin))
            return torch.frombuffer(raw, dtype=dtype).reshape(info.shape)
        if self._storage is None:
            self._storage = torch.UntypedStorage.from_file(  # type: ignore[assignment]
                str(self.path), False, self.size)  # (stubs: the base storage class)
        out = torch.empty(0, dtype=dtype)
        out.set_(self._storage, info.begin // itemsize, info.shape)  # type: ignore[call-overload]
        return out


    def maps(self, t: torch.Tensor) -> bool:
        """Whether ``t`` views this file's mapping."""
        if self._storage is None or t.is_mkldnn:
            return False
        base = self._storage.data_ptr()
        return base <= t.untyped_storage().data_ptr() < base + self.size

    def drop_pages(self) -> None:
        """Let the pages read through the mapping so far leave the process (they stay in
        the page cache; a tensor still viewing them reads them back on its next use): a
        load that packs or quantizes each weight into a copy as it goes calls this after
        each layer, so its peak holds one layer's file pages, not the whole file's. Safe
        because nothing writes through the mapping (copy-on-write pages would be lost)."""
        if self._storage is not None:
            drop_mapped_pages(self._storage.data_ptr(), self.size)

    def unmap(self) -> None:
        """Drop this object's reference to the mapping (unmapped once no tensor views it)."""
        self._storage = None


def read_header(path: Path) -> SafetensorsFile:
    """Parse one file's header; LoaderError names the file and the defect."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise LoaderError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise LoaderError(f"{path}: corrupt safetensors header length {n}")
            header_bytes = f.read(n)
    except OSError as exc:
        raise LoaderError(f"{path}: cannot read weights file: {exc}") from exc
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoaderError(f"{path}: malformed safetensors header JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise LoaderError(f"{path}: safetensors header is not a JSON object")
    data_start = 8 + n
    tensors: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in meta["data_offsets"])
            info = TensorInfo(
                str(meta["dtype"]),
                tuple(int(d) for d in meta["shape"]),
                data_start + begin,
                data_start + end,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise LoaderError(f"{path}: bad header entry for tensor {name!r}: {exc}") from exc
        if info.end > size or info.begin > info.end:
            raise LoaderError(f"{path}: tensor {name!r} lies outside the file (truncated?)")
        tensors[name] = info
    return SafetensorsFile(path, size, header_bytes, tensors)


def weight_files(folder: Path) -> list[Path]:
    """The weights files of a model folder: the index's shards, or every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (
            OSError,
            UnicodeDecodeError,
            json.JSONDecodeError,
            KeyError,
            TypeError,
            AttributeError,
        ) as exc:
            raise LoaderError(f"{index}: malformed index (needs a 'weight_map'): {exc}") from exc
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise LoaderError(
                f"{index}: shard(s) named in the index are missing: "
                + ", ".join(str(folder / m) for m in missing)
            )
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise LoaderError(f"{folder}: no *.safetensors weights found")
    return files
