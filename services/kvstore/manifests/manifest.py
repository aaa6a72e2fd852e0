"""Session manifests: which chunks make up a session's KV (DESIGN §2).

A manifest names chunks implicitly: the session's block hashes split into chunks of
``blocks_per_chunk`` blocks, times ``num_layers`` layers::

    blocks:  | b0 b1 ... b15 | b16 ... b31 | b32 b33 |      (blocks_per_chunk = 16)
    chunks:  |   chunk 0     |  chunk 1    | chunk 2 |      key uses its LAST block hash
    keys:    tenant/model_fp/hex(b15)/layer, .../hex(b31)/layer, .../hex(b33)/layer

It is written only after every one of those chunks is durable in the lowest tier.

Stored as ``b"OVKM" | 16-byte MAC tag | msgpack map``: the tag (``shared/chunk_mac``, the
tenant's key) covers the manifest's key and its bytes, so a forged manifest, or one moved
under another session's or tenant's key, is refused on read like a corrupt one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgpack

from shared import chunk_mac
from shared.chunk_codec import MAX_HASH_BYTES, MAX_NAME_CHARS, ChunkFormatError, chunk_key

# 128 layers x 2048 chunks: a 512k-token context at 16 blocks of 16 tokens per chunk.
MAX_MANIFEST_CHUNKS = 1 << 18
MAX_MODEL_LAYERS = 1024  # far above any model's; bounds what a request can name
MANIFEST_MAGIC = b"OVKM"
MANIFEST_HEAD = len(MANIFEST_MAGIC) + chunk_mac.TAG_BYTES


@dataclass(frozen=True)
class Manifest:
    tenant: str
    session_id: str
    model_fp: str
    block_hashes: tuple[bytes, ...]
    token_count: int
    num_layers: int
    blocks_per_chunk: int
    updated: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        manifest_key(self.tenant, self.session_id)  # the names (ChunkFormatError) ...
        chunk_key(self.tenant, self.model_fp, b"\0", 0)  # ... and the model's
        if self.num_layers < 1 or self.blocks_per_chunk < 1 or self.token_count < 0:
            raise ChunkFormatError("num_layers and blocks_per_chunk must be >= 1, token_count >= 0")
        # A manifest comes from clients and peers: bound the work it can ask for (every
        # chunk it names is checked for durability before it is written).
        chunks = -(-len(self.block_hashes) // self.blocks_per_chunk) * self.num_layers
        if self.num_layers > MAX_MODEL_LAYERS or chunks > MAX_MANIFEST_CHUNKS:
            raise ChunkFormatError(
                f"a manifest names at most {MAX_MANIFEST_CHUNKS} chunks (layers x chunks per "
                f"layer); this one {self.num_layers} x {chunks // self.num_layers}")
        if any(not isinstance(h, bytes) or not 0 < len(h) <= MAX_HASH_BYTES
               for h in self.block_hashes):
            raise ChunkFormatError(f"block hashes must be 1 to {MAX_HASH_BYTES} bytes")

    @property
    def key(self) -> str:
        return manifest_key(self.tenant, self.session_id)

    def chunk_block_ranges(self) -> list[tuple[int, int]]:
        """Half-open block index ranges of the chunks, in token order."""
        n, c = len(self.block_hashes), self.blocks_per_chunk
        return [(s, min(s + c, n)) for s in range(0, n, c)]

    def chunk_hashes(self, index: int) -> tuple[bytes, ...]:
        s, e = self.chunk_block_ranges()[index]
        return self.block_hashes[s:e]

    def layer_keys(self, layer: int) -> list[str]:
        return [
            chunk_key(self.tenant, self.model_fp, self.block_hashes[e - 1], layer)
            for _s, e in self.chunk_block_ranges()
        ]

    def chunk_keys(self) -> list[str]:
        """Every chunk key, lowest layer first (the order of layer-wise loads)."""
        return [k for layer in range(self.num_layers) for k in self.layer_keys(layer)]

    def encode(self) -> bytes:
        """The stored form: magic, MAC tag, msgpack body."""
        return sealed_manifest(self.key, self._body())

    def _body(self) -> bytes:
        return msgpack.packb(
            {
                "tenant": self.tenant,
                "session_id": self.session_id,
                "model_fp": self.model_fp,
                "hashes": list(self.block_hashes),
                "tokens": self.token_count,
                "layers": self.num_layers,
                "bpc": self.blocks_per_chunk,
                "updated": self.updated,
            }
        )

    @classmethod
    def decode(cls, data: bytes | bytearray, key: str) -> Manifest:
        """The manifest stored under ``key`` (``manifest_key``). Raises ``ChunkFormatError``
        for anything but a well-formed manifest whose MAC is this cluster's for ``key`` (it
        is read from disks, S3 and peers)."""
        view = memoryview(data)
        if (len(view) < MANIFEST_HEAD or view[:len(MANIFEST_MAGIC)] != MANIFEST_MAGIC
                or not chunk_mac.same(view[len(MANIFEST_MAGIC):MANIFEST_HEAD],
                                      _manifest_tag(key, view[MANIFEST_HEAD:]))):
            raise ChunkFormatError(f"manifest {key[:200]}: MAC mismatch (corrupt, forged, "
                                   "or another session's)")
        m = cls._decode_body(view[MANIFEST_HEAD:])
        if m.key != key:  # (the tag covers the key: only a forger's own key could do this)
            raise ChunkFormatError(f"the manifest under {key[:200]} is {m.key[:200]}")
        return m

    @classmethod
    def _decode_body(cls, data: memoryview) -> Manifest:
        try:
            h = msgpack.unpackb(data)
            if not isinstance(h, dict):
                raise ValueError("not a map")
            texts = [h["tenant"], h["session_id"], h["model_fp"]]
            numbers = [h["tokens"], h["layers"], h["bpc"]]
            if (not all(isinstance(t, str) for t in texts) or not isinstance(h["hashes"], list)
                    or not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers)
                    or not isinstance(h["updated"], int | float)):
                raise ValueError("a field of the wrong type")
            return cls(texts[0], texts[1], texts[2],
                       block_hashes=tuple(h["hashes"]),  # (bytes: checked after)
                       token_count=numbers[0], num_layers=numbers[1],
                       blocks_per_chunk=numbers[2], updated=float(h["updated"]))
        except ChunkFormatError:
            raise
        except (ValueError, KeyError, TypeError, OverflowError) as e:
            raise ChunkFormatError(f"malformed manifest: {type(e).__name__}: {e}"[:300]
                                   ) from None


def sealed_manifest(key: str, body: bytes) -> bytes:
    """``body`` (a msgpack map) as stored under ``key``: magic and MAC tag before it."""
    return MANIFEST_MAGIC + _manifest_tag(key, body) + body


def _manifest_tag(key: str, body: bytes | memoryview) -> bytes:
    h = chunk_mac.hasher(key.partition("/")[0], chunk_mac.MANIFEST_DOMAIN)
    h.update(key.encode() + b"\0")
    h.update(body)
    return chunk_mac.tag(h)


def scoped_session(session_id: str, model_fp: str) -> str:
    """The session's name inside the kvstore: one per model (a session that switches model
    keeps each model's manifest; DESIGN's keys carry the model, so must its manifests).
    A name already scoped, or given without a model (a peer naming what it holds), stays."""
    if not session_id or not model_fp:
        return session_id
    return f"{session_id}@{model_fp[:16]}"


def manifest_key(tenant: str, session_id: str) -> str:
    if (not tenant or "/" in tenant or not session_id or "/" in session_id
            or len(tenant) > MAX_NAME_CHARS or len(session_id) > MAX_NAME_CHARS):
        raise ChunkFormatError(
            f"tenant and session_id must be non-empty without '/', at most {MAX_NAME_CHARS} "
            "characters")
    return f"{tenant}/{session_id}"
