"""The chunk format: one layer x up to ``chunk_tokens`` tokens of KV, under a keyed MAC.

A chunk travels as one contiguous blob::

    0        4    6     8              12              28               28+H+pad       +N
    | magic  | ver| flg | header len H | MAC tag       | msgpack header | raw tensor bytes |
    | b"OVKC"| u16| u16 | u32          | 16 bytes      | (H bytes), pad | (N bytes)        |

The payload starts at the next multiple of 64 after the header (zero padding), so the
tensor view is aligned for vectorised copies.

The fixed 28-byte preamble plus the msgpack map (tenant, model fingerprint, layer, block
hashes, dtype, shape, payload length) form the header. The tag covers the msgpack header
and the payload, so a flipped byte anywhere after the preamble is caught.

Why a keyed MAC (format 3; 2 was an unkeyed XXH3-64 anyone who can write to a tier could
recompute): HMAC-SHA256 under the tenant's key from the cluster secret (``chunk_mac``)
over the header, which names the chunk's identity, and the payload; a reader that asked
for key K accepts only K's header (``verify_chunk(blob, key)``), so a forged chunk or one
moved under another key (another session's, tenant's) is refused. Every SSD, S3 and peer
read pays it (``bench/kvstore/chunk_mac.py``); DRAM reads do not (never left the process).

Why a separate *seal* step: the copy of a KV block out of the engine's pool is on the
critical path (the block stays pinned until the copy is acknowledged); the MAC is not.
``encode_chunk(..., seal=False)`` copies the tensor only; ``seal`` computes the tag in place
later (the kvstore does it on its write-behind path), and it must happen before the blob
leaves the process (SSD, S3, a peer). ``decode_chunk(verify=True)`` rejects unsealed blobs.

One verify, for whole blobs and for a payload read in parts (a ranged or layer-wise
read): ``verify_chunk`` / ``verify_parts``; a chunk is one layer, so a reader of layer l
verifies exactly the chunks of layer l it read.

Decoding never copies the payload: the tensor is ``torch.frombuffer`` over the blob.
"""

from __future__ import annotations

import ctypes
import functools
import math
import struct
import threading
from typing import TYPE_CHECKING, Any, NamedTuple

import msgpack

from shared import chunk_mac
from shared.chunk_format import (  # re-exported: the codec is where callers look
    _ALIGN,
    _FLAG_SEALED,
    _PREAMBLE,
    _SUM_OFFSET,
    DTYPE_NAMES,
    FORMAT_VERSION,
    MAGIC,
    MAX_HASH_BYTES,
    MAX_LAYER,
    MAX_NAME_CHARS,
    PREAMBLE_BYTES,
    Chunk,
    ChunkCorrupt,
    ChunkFormatError,
    ChunkMeta,
    StorageError,
    _chunk_tag,
    _dtype,
    _payload_offset,
    _tenant_of,
    _torch,
    chunk_key,
)

__all__ = [
    "DTYPE_NAMES", "FORMAT_VERSION", "MAGIC", "MAX_HASH_BYTES", "MAX_LAYER", "MAX_NAME_CHARS",
    "PREAMBLE_BYTES", "Chunk", "ChunkCorrupt", "ChunkFormatError", "ChunkHead", "ChunkMeta",
    "ExpectedHead", "StorageError", "chunk_key", "decode_chunk", "encode_chunk",
    "head_length", "is_sealed", "parse_head", "read_meta", "seal_chunk", "verify_chunk",
    "verify_parts",
]

if TYPE_CHECKING:
    import torch

_ZEROS = bytes(_ALIGN)
_BYTES = frozenset((bytes,))
_local = threading.local()
_HEADER_FIELDS = 7  # tenant, model_fp, dtype, shape, nbytes, layer, hashes
_DTYPE_NAME: dict[Any, str] = {}  # torch.dtype -> wire name, filled on first use


class _Layout(NamedTuple):
    fixed: bytes  # the msgpack map's count and its per-session entries, packed once
    nbytes: int  # payload bytes of a tensor of this dtype and shape


_LAYOUTS: dict[tuple[str, str, Any, tuple[int, ...]], _Layout] = {}
_MAX_LAYOUTS = 1024
_PREFIXES: dict[tuple[bytes, int], tuple[bytes, bytes]] = {}  # see ``_prefix``
_MAX_PREFIXES = 4096  # (a layout's tail lengths vary with hash count and lengths)


def _layout(tenant: str, model_fp: str, dtype: torch.dtype, shape: tuple[int, ...]) -> _Layout:
    """The header part shared by every chunk of one tenant, model, dtype and shape.

    A session's chunks share all of these, and packing the whole map per chunk was the
    largest cost of a small put after the copy (DRAM puts of 64 KiB are measured against a
    plain tensor copy). ``_header_tail`` completes the map: the result is the map a
    ``packb`` of the dict gives (keys in another order; readers look fields up by name).
    """
    k = (tenant, model_fp, dtype, shape)
    lay = _LAYOUTS.get(k)
    if lay is None:
        dtype_name = _dtype_name(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        assert _HEADER_FIELDS < 16  # a fixmap
        packed = msgpack.packb({"tenant": tenant, "model_fp": model_fp, "dtype": dtype_name,
                                "shape": list(shape), "nbytes": nbytes})
        if len(_LAYOUTS) >= _MAX_LAYOUTS:  # bounded: names come from clients
            _LAYOUTS.clear()
        lay = _LAYOUTS[k] = _Layout(bytes((0x80 | _HEADER_FIELDS,)) + packed[1:], nbytes)
    return lay


def _prefix(fixed: bytes, tail_len: int) -> tuple[bytes, bytes]:
    """What goes before and after a tail of ``tail_len`` bytes: the preamble (unsealed,
    zero tag) and ``fixed``; the zero padding that aligns the payload."""
    p = _PREFIXES.get((fixed, tail_len))
    if p is None:
        if len(_PREFIXES) >= _MAX_PREFIXES:
            _PREFIXES.clear()
        hlen = len(fixed) + tail_len
        p = _PREFIXES[(fixed, tail_len)] = (
            _PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, hlen, b"") + fixed,
            _ZEROS[: _payload_offset(hlen) - PREAMBLE_BYTES - hlen])
    return p


def _header_tail(meta: ChunkMeta) -> bytes:
    """The map's last two entries: one packed array of key, value, key, value, minus the
    array's own type byte (a fixarray of 4) is exactly those four items in a row."""
    packer = getattr(_local, "packer", None)
    if packer is None:  # one per thread: encodes run on the loop and on worker threads
        packer = _local.packer = msgpack.Packer()
    try:
        packed: bytes = packer.pack(("layer", meta.layer, "hashes", meta.block_hashes))
        return packed[1:]
    except (TypeError, ValueError) as e:  # the packer resets itself on failure
        raise ChunkFormatError(f"unpackable chunk fields: {e}") from None


@functools.lru_cache(maxsize=256)
def _byte_array(nbytes: int) -> type[ctypes.Array[ctypes.c_char]]:
    return ctypes.c_char * nbytes


def _dtype_name(dtype: Any) -> str:
    name = _DTYPE_NAME.get(dtype)
    if name is None:
        name = str(dtype).removeprefix("torch.")
        if name not in DTYPE_NAMES:
            raise ChunkFormatError(f"unsupported dtype {dtype}; known: {', '.join(DTYPE_NAMES)}")
        _DTYPE_NAME[dtype] = name
    return name


def encode_chunk(meta: ChunkMeta, tensor: torch.Tensor, *, seal: bool = True) -> bytearray:
    """Copy ``tensor`` (any shape, a supported dtype) into a new chunk blob.

    The tensor is copied exactly once, straight into the blob. ``seal=False`` defers the
    checksum to ``seal(blob)``.
    """
    if not tensor.is_cpu:
        raise ChunkFormatError("encode_chunk needs a CPU tensor (copy it to host first)")
    if not meta.block_hashes:
        raise ChunkFormatError("a chunk names at least one block hash")
    _ = meta.key  # validates the fields
    fixed, nbytes = _layout(meta.tenant, meta.model_fp, tensor.dtype, tensor.shape)
    tail = _header_tail(meta)
    head, pad = _prefix(fixed, len(tail))
    blob = bytearray(head)
    blob += tail
    blob += pad
    if nbytes:
        # bytearray.extend of a buffer is one realloc + one memcpy (no zero-fill pass, and
        # no torch copy kernel, whose thread fan-out costs more than the copy for
        # chunk-sized tensors). The buffer is a ctypes view of the tensor's bytes: unlike
        # ``.numpy()`` it is cheap to make and covers dtypes numpy lacks (bfloat16, fp8).
        flat = tensor if tensor.is_contiguous() else tensor.contiguous()
        if flat.is_neg():  # a lazily negated view: its memory holds the un-negated values
            flat = flat.resolve_neg()
        blob.extend(_byte_array(nbytes).from_address(flat.data_ptr()))
    if seal:
        seal_chunk(blob)
    return blob


def seal_chunk(blob: bytearray) -> None:
    """Compute the MAC of an encoded blob in place (idempotent; any thread)."""
    _magic, _ver, flags, _hlen, _old = _parse_preamble(blob)
    if flags & _FLAG_SEALED:
        return
    tag = _chunk_tag(blob, _tenant_of(blob))
    blob[_SUM_OFFSET : _SUM_OFFSET + chunk_mac.TAG_BYTES] = tag
    struct.pack_into("<H", blob, 6, flags | _FLAG_SEALED)


def is_sealed(blob: bytes | bytearray | memoryview) -> bool:
    return bool(_parse_preamble(blob)[2] & _FLAG_SEALED)


def _parse_preamble(blob: bytes | bytearray | memoryview
                    ) -> tuple[bytes, int, int, int, bytes]:
    if len(blob) < PREAMBLE_BYTES:
        raise ChunkCorrupt(f"blob of {len(blob)} bytes is shorter than the chunk preamble")
    magic, ver, flags, hlen, checksum = _PREAMBLE.unpack_from(blob, 0)
    if magic != MAGIC:
        raise ChunkCorrupt(f"bad magic {magic!r}")
    if ver != FORMAT_VERSION:
        raise ChunkCorrupt(f"unknown chunk format version {ver}")
    if flags & ~_FLAG_SEALED:  # (the tag does not cover the flags: no stray bits)
        raise ChunkCorrupt(f"unknown chunk flags {flags:#06x}")
    if PREAMBLE_BYTES + hlen > len(blob):
        raise ChunkCorrupt("header length runs past the end of the blob")
    return magic, ver, flags, hlen, checksum


def verify_chunk(blob: bytes | bytearray | memoryview, key: str | None = None) -> None:
    """Raise ``ChunkCorrupt`` unless the blob is sealed, its MAC matches under its
    tenant's key, and (``key`` given: the key it was read under) it is chunk ``key``.

    The one check of a stored chunk, wherever it was read from; ``verify_parts`` is the
    same for a payload read into separate buffers."""
    _m, _v, flags, _hlen, stored = _parse_preamble(blob)
    if not flags & _FLAG_SEALED:
        raise ChunkCorrupt("chunk is not sealed (no MAC)")
    meta = read_meta(blob)
    if key is not None and meta.key != key:
        raise ChunkCorrupt(f"the chunk stored under {key[:120]} is {meta.key[:120]}")
    if not chunk_mac.same(stored, _chunk_tag(blob, meta.tenant)):
        raise ChunkCorrupt("MAC mismatch: corrupt, or not sealed with this cluster's key")


def decode_chunk(blob: bytes | bytearray | memoryview, *, verify: bool = True,
                 key: str | None = None) -> Chunk:
    """Parse a blob into ``Chunk``; the tensor views the blob's payload (no copy).

    ``verify=False`` skips the MAC (only for blobs this process encoded and kept in RAM);
    ``key``: the key it was read under, which it must be (see ``verify_chunk``).
    Raises ``ChunkCorrupt`` for any malformed or mismatching blob.
    """
    if verify:
        verify_chunk(blob, key)
    head = parse_head(blob, len(blob))
    torch = _torch()
    dtype = _dtype(head.dtype)
    if head.nbytes == 0:
        return Chunk(head.meta, torch.empty(head.shape, dtype=dtype))
    flat = torch.frombuffer(blob, dtype=dtype, count=math.prod(head.shape),
                            offset=head.payload_offset)
    return Chunk(head.meta, flat.view(head.shape))


class ChunkHead(NamedTuple):
    """Everything before a chunk's payload, parsed: enough to place the payload (a reader
    can then read it straight to where it is going) and to verify it afterwards."""

    meta: ChunkMeta
    dtype: str  # a name in DTYPE_NAMES
    shape: tuple[int, ...]
    nbytes: int  # payload bytes
    payload_offset: int
    checksum: bytes  # the stored MAC tag; meaningful only if sealed
    sealed: bool
    hashed_prefix: bytes  # the header bytes the MAC covers before the payload


def head_length(prefix: bytes | bytearray | memoryview) -> int:
    """How many leading bytes of a blob ``parse_head`` needs, given at least its preamble."""
    if len(prefix) < PREAMBLE_BYTES:
        raise ChunkCorrupt(f"blob of {len(prefix)} bytes is shorter than the chunk preamble")
    magic, ver, _flags, hlen, _sum = _PREAMBLE.unpack_from(prefix, 0)
    if magic != MAGIC:
        raise ChunkCorrupt(f"bad magic {magic!r}")
    if ver != FORMAT_VERSION:
        raise ChunkCorrupt(f"unknown chunk format version {ver}")
    return _payload_offset(hlen)


def parse_head(prefix: bytes | bytearray | memoryview, total: int) -> ChunkHead:
    """Parse the head of a blob of ``total`` bytes from its first ``head_length`` bytes (or
    more); checks the payload length against the header, not the MAC."""
    _m, _v, flags, hlen, checksum = _parse_preamble(prefix)
    start = _payload_offset(hlen)
    if len(prefix) < min(start, total):
        raise ValueError(f"parse_head needs the first {start} bytes, got {len(prefix)}")
    try:
        h = msgpack.unpackb(memoryview(prefix)[PREAMBLE_BYTES : PREAMBLE_BYTES + hlen])
        meta = _meta_of(h)
        if h["dtype"] not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {h['dtype']!r}")
        dtype_name = str(h["dtype"])
        shape = tuple(map(int, h["shape"]))
        nbytes = int(h["nbytes"])
    except (KeyError, TypeError, ValueError, msgpack.UnpackException) as e:
        raise ChunkCorrupt(f"unreadable chunk header: {e}") from None
    numel = math.prod(shape)
    if (start + nbytes != total or numel * _dtype(dtype_name).itemsize != nbytes
            or min(shape, default=0) < 0):
        raise ChunkCorrupt("payload length does not match header shape/dtype")
    return ChunkHead(meta, dtype_name, shape, nbytes, start, checksum,
                     bool(flags & _FLAG_SEALED), bytes(memoryview(prefix)[PREAMBLE_BYTES:start]))


class ExpectedHead:
    """The head ``encode_chunk`` writes for one known chunk, to recognise it by comparison.

    A reader that knows exactly which chunk it wants (the pool load: the lookup leased the
    chunk with its block hashes, the pool fixes dtype and shape) can read the head and the
    payload in one go and compare the head's bytes with these instead of unpacking and
    checking it (``parse_head``): on the SSD load path that parse was a fifth of the CPU
    spent per chunk besides the copy. A head that differs (another encoder's key order, a
    forged or stale chunk) is not an error here: ``match`` says None and the reader parses.
    """

    __slots__ = ("_hashed", "_lead", "dtype", "meta", "nbytes", "payload_offset", "shape")

    def __init__(self, meta: ChunkMeta, dtype_name: str, shape: tuple[int, ...]) -> None:
        if dtype_name not in DTYPE_NAMES:
            raise ChunkFormatError(f"unsupported dtype {dtype_name!r}")
        _ = meta.key  # validates the fields
        fixed, self.nbytes = _layout(meta.tenant, meta.model_fp, _dtype(dtype_name), shape)
        tail = _header_tail(meta)
        _head, pad = _prefix(fixed, len(tail))
        self.meta, self.dtype, self.shape = meta, dtype_name, shape
        hlen = len(fixed) + len(tail)  # magic, version, flags, header length of a sealed chunk:
        self._lead = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, _FLAG_SEALED, hlen, b"")[:_SUM_OFFSET]
        self._hashed = fixed + tail + pad
        self.payload_offset = PREAMBLE_BYTES + len(self._hashed)

    def match(self, prefix: bytes | bytearray | memoryview, total: int) -> ChunkHead | None:
        """The head of a blob of ``total`` bytes whose first ``payload_offset`` bytes are
        ``prefix``, if it is this chunk's, sealed; else None."""
        mv = memoryview(prefix)
        if (total != self.payload_offset + self.nbytes or len(mv) < self.payload_offset
                or mv[:_SUM_OFFSET] != self._lead
                or mv[PREAMBLE_BYTES : self.payload_offset] != self._hashed):
            return None
        tag = bytes(mv[_SUM_OFFSET:PREAMBLE_BYTES])
        return ChunkHead(self.meta, self.dtype, self.shape, self.nbytes, self.payload_offset,
                         tag, True, self._hashed)


def verify_parts(head: ChunkHead, payload: list[memoryview]) -> None:
    """``verify_chunk`` for a chunk whose payload was read into separate buffers (in
    order): the MAC streams over them, so they need not be contiguous. The head names
    the chunk's identity: a caller that wants chunk K checks ``head.meta`` is K's (an
    ``ExpectedHead`` match is)."""
    if not head.sealed:
        raise ChunkCorrupt("chunk is not sealed (no MAC)")
    h = chunk_mac.hasher(head.meta.tenant, chunk_mac.CHUNK_DOMAIN)
    h.update(head.hashed_prefix)
    for part in payload:
        h.update(part)
    if not chunk_mac.same(head.checksum, chunk_mac.tag(h)):
        raise ChunkCorrupt("MAC mismatch: corrupt, or not sealed with this cluster's key")


def read_meta(blob: bytes | bytearray | memoryview) -> ChunkMeta:
    """The chunk's identity without touching the payload (no MAC check)."""
    _m, _v, _f, hlen, _c = _parse_preamble(blob)
    try:
        return _meta_of(msgpack.unpackb(memoryview(blob)[PREAMBLE_BYTES : PREAMBLE_BYTES + hlen]))
    except (KeyError, TypeError, ValueError, msgpack.UnpackException) as e:
        raise ChunkCorrupt(f"unreadable chunk header: {e}") from None


def _meta_of(h: Any) -> ChunkMeta:
    """The identity in an unpacked header, checked as strictly as ``encode_chunk`` checks
    its input (a header from a peer or a client is untrusted: its key must be one that
    ``chunk_key`` could have made). Raises ValueError/TypeError/KeyError."""
    hashes = tuple(h["hashes"])
    if not hashes or not set(map(type, hashes)) <= _BYTES:  # msgpack bin is bytes
        raise ValueError("block hashes must be a non-empty list of bytes")
    if max(map(len, hashes)) > MAX_HASH_BYTES:
        raise ValueError(f"a block hash is longer than {MAX_HASH_BYTES} bytes")
    tenant, model_fp, layer = h["tenant"], h["model_fp"], h["layer"]
    # What chunk_key would refuse, checked without building the key (every read parses a
    # header: ~0.5 us here against ~3.5 us for the key).
    if type(tenant) is not str or type(model_fp) is not str or type(layer) is not int:
        raise TypeError("tenant and model_fp must be strings, layer an integer")
    if (not tenant or not model_fp or "/" in tenant or "/" in model_fp
            or len(tenant) > MAX_NAME_CHARS or len(model_fp) > MAX_NAME_CHARS):
        raise ValueError("tenant and model_fp must be non-empty, short, without '/'")
    if not 0 <= layer <= MAX_LAYER:
        raise ValueError(f"layer {layer} is out of range")
    return ChunkMeta(tenant, model_fp, layer, hashes)
