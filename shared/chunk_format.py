"""The chunk format's vocabulary: the preamble's layout, names and limits, the errors, and
the identity of a chunk (``ChunkMeta``, ``chunk_key``). Encoding and decoding are in
``chunk_codec``, which re-exports all of this.
"""

from __future__ import annotations

import functools
import struct
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

from shared import chunk_mac

if TYPE_CHECKING:
    import torch

MAGIC = b"OVKC"
FORMAT_VERSION = 3  # 1 was CRC-32, 2 an unkeyed xxh3-64; 3 a keyed MAC (chunk_mac)
_PREAMBLE = struct.Struct(f"<4sHHI{chunk_mac.TAG_BYTES}s")  # magic, version, flags,
PREAMBLE_BYTES = _PREAMBLE.size  # 28                     header length, MAC tag
_FLAG_SEALED = 1
_SUM_OFFSET = 12
_ALIGN = 64
# Bounds on untrusted headers (far above real use: hashes are 16 bytes, models < 200 layers)
# so that a forged one cannot make a huge key or an integer that overflows downstream.
MAX_HASH_BYTES = 64
MAX_LAYER = (1 << 16) - 1
MAX_NAME_CHARS = 256  # tenant, model fingerprint, session id


def _payload_offset(header_len: int) -> int:
    end = PREAMBLE_BYTES + header_len
    return end + (-end) % _ALIGN


# Supported payload dtypes by wire name (= ``str(torch.dtype)`` without "torch.").
DTYPE_NAMES = (
    "float32", "float16", "bfloat16", "float64", "int8", "uint8", "int32", "int64",
    "float8_e4m3fn", "float8_e5m2",
)


@functools.cache
def _torch() -> Any:
    # torch is imported on first encode/decode only: the kvstore server moves sealed blobs
    # and never needs it, and importing it costs seconds of process start-up.
    import torch

    # torch.frombuffer warns (once per process) that a read-only buffer makes a read-only
    # tensor's writes undefined. Decoded tensors over bytes from RocksDB/S3 are read-only by
    # contract, and avoiding the warning would cost a copy: spend the one warning here,
    # silenced, instead of wrapping every decode in catch_warnings (which is slow and
    # races when decodes run on the tiers' reader threads).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(b"\0", dtype=torch.uint8)
    return torch


def _dtype(name: str) -> torch.dtype:
    dtype: torch.dtype = getattr(_torch(), name)
    return dtype


class StorageError(Exception):
    """Base of every kvstore storage failure; callers turn it into a miss or a recompute."""


class ChunkCorrupt(StorageError):
    """A blob is not a valid chunk: bad magic/version, truncated, a MAC that does not
    match (corrupt, forged), or another chunk than the key it was stored under (swapped).

    Distinct from a miss (``None``): the data existed and was wrong. The store counts it,
    deletes the bad copy and reports a miss to its caller.
    """


class ChunkFormatError(ValueError):
    """The caller asked to encode something that is not a valid chunk (bad input)."""


@dataclass(frozen=True)
class ChunkMeta:
    """Identity of a chunk: one layer of the tokens covered by ``block_hashes``.

    ``block_hashes`` are the chained content hashes (DESIGN §2) of the blocks in the chunk,
    in token order; the chunk's key uses the last one.
    """

    tenant: str
    model_fp: str
    layer: int
    block_hashes: tuple[bytes, ...]

    @functools.cached_property
    def key(self) -> str:
        """The store key (validates the fields; computed once: the put path uses it often)."""
        for h in self.block_hashes[:-1]:  # chunk_key checks the last one
            if not isinstance(h, (bytes, bytearray)) or not 0 < len(h) <= MAX_HASH_BYTES:
                # as strict as a read's ``_meta_of``: nothing written here is unreadable
                raise ChunkFormatError(f"a block hash must be 1 to {MAX_HASH_BYTES} bytes")
        return chunk_key(self.tenant, self.model_fp, self.block_hashes[-1], self.layer)


@dataclass(frozen=True)
class Chunk:
    """A decoded chunk. ``tensor`` shares memory with the blob (read-only by contract)."""

    meta: ChunkMeta
    tensor: torch.Tensor


def _check_name(what: str, value: str) -> None:
    if not value or "/" in value or len(value) > MAX_NAME_CHARS:
        raise ChunkFormatError(f"{what} must be a non-empty string without '/', at most "
                               f"{MAX_NAME_CHARS} characters, got {value[:80]!r}")


def chunk_key(tenant: str, model_fp: str, last_block_hash: bytes, layer: int) -> str:
    """``tenant/model_fp/<hex hash of the chunk's last block>/<layer>``."""
    _check_name("tenant", tenant)
    _check_name("model_fp", model_fp)
    if not isinstance(last_block_hash, (bytes, bytearray)) or not last_block_hash:
        raise ChunkFormatError("a block hash must be non-empty bytes")
    if len(last_block_hash) > MAX_HASH_BYTES:
        raise ChunkFormatError(f"a block hash is longer than {MAX_HASH_BYTES} bytes")
    if not 0 <= layer <= MAX_LAYER:
        raise ChunkFormatError(f"layer must be in [0, {MAX_LAYER}], got {layer}")
    return f"{tenant}/{model_fp}/{bytes(last_block_hash).hex()}/{layer}"


def _tenant_of(blob: bytearray) -> str:
    """The header's tenant, for the key of the MAC; "" when unreadable (sealing does not
    judge the header: ``verify_chunk`` refuses a malformed one anyway)."""
    hlen = _PREAMBLE.unpack_from(blob, 0)[3]
    try:
        h = msgpack.unpackb(memoryview(blob)[PREAMBLE_BYTES : PREAMBLE_BYTES + hlen])
    except (ValueError, msgpack.UnpackException):
        return ""
    tenant = h.get("tenant") if isinstance(h, dict) else None
    return tenant if isinstance(tenant, str) else ""


def _chunk_tag(blob: bytes | bytearray | memoryview, tenant: str) -> bytes:
    # Over msgpack header (the chunk's identity) + payload, with the tenant's key; the
    # preamble carries the result.
    h = chunk_mac.hasher(tenant, chunk_mac.CHUNK_DOMAIN)
    h.update(memoryview(blob)[PREAMBLE_BYTES:])
    return chunk_mac.tag(h)
