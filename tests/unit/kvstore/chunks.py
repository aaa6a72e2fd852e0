"""Tiny deterministic chunks for kvstore tests."""

from __future__ import annotations

import hashlib
import zlib

import msgpack
import torch

from services.kvstore.manifests.manifest import Manifest
from shared.chunk_codec import (
    _PREAMBLE,
    FORMAT_VERSION,
    PREAMBLE_BYTES,
    ChunkMeta,
    encode_chunk,
    seal_chunk,
)

TENANT = "t1"
MODEL = "fp0"


def block_hash(session: str, i: int) -> bytes:
    return hashlib.blake2b(f"{session}:{i}".encode(), digest_size=16).digest()


def kv_tensor(seed: int, tokens: int = 4, heads: int = 2, dim: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, tokens, heads, dim, generator=g)  # (K/V, tokens, kv_heads, head_dim)


def meta(session: str, block: int, layer: int, blocks: int = 1) -> ChunkMeta:
    hashes = tuple(block_hash(session, b) for b in range(block - blocks + 1, block + 1))
    return ChunkMeta(TENANT, MODEL, layer, hashes)


def session_manifest(session: str, num_blocks: int, num_layers: int, bpc: int) -> Manifest:
    return Manifest(
        tenant=TENANT, session_id=session, model_fp=MODEL,
        block_hashes=tuple(block_hash(session, b) for b in range(num_blocks)),
        token_count=num_blocks * 4, num_layers=num_layers, blocks_per_chunk=bpc,
    )


def session_chunks(m: Manifest) -> list[tuple[ChunkMeta, torch.Tensor]]:
    """Every chunk of a manifest with deterministic content, lowest layer first."""
    out = []
    for layer in range(m.num_layers):
        for i in range(len(m.chunk_block_ranges())):
            cm = ChunkMeta(m.tenant, m.model_fp, layer, m.chunk_hashes(i))
            out.append((cm, kv_tensor(seed=zlib.crc32(f"{m.session_id}:{layer}:{i}".encode()))))
    return out


def forged_chunk(seal: bool = True, **fields) -> bytearray:
    """A chunk whose header fields are replaced by ``fields`` (sealed: its checksum fits)."""
    t = kv_tensor(10)
    blob = encode_chunk(meta("s", 0, 0), t, seal=False)
    hlen = _PREAMBLE.unpack_from(blob)[3]
    h = msgpack.unpackb(bytes(blob[PREAMBLE_BYTES : PREAMBLE_BYTES + hlen]))
    h.update(fields)
    header = msgpack.packb(h)
    forged = bytearray(_PREAMBLE.pack(b"OVKC", FORMAT_VERSION, 0, len(header), b"")) + header
    forged += bytes(-len(forged) % 64) + t.numpy().tobytes()
    if seal:
        seal_chunk(forged)
    return forged
