"""Chunks carry a keyed MAC (issue 43): a chunk re-sealed by anyone without the cluster
secret, or a genuine chunk read under another key (another session's chunk, another
tenant's), is corrupt, like a flipped byte."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import msgpack
import pytest

from bench.harness import CLUSTER_SECRET
from shared import internal_auth
from shared.chunk_codec import (
    _PREAMBLE,
    PREAMBLE_BYTES,
    ChunkCorrupt,
    ChunkMeta,
    decode_chunk,
    encode_chunk,
    seal_chunk,
    verify_chunk,
)
from tests.unit.kvstore.chunks import kv_tensor, meta


@contextmanager
def secret(value: str | None) -> Iterator[None]:
    """This process's cluster secret is ``value`` inside (an attacker's, or none)."""
    internal_auth.configure(value)
    try:
        yield
    finally:
        internal_auth.configure(CLUSTER_SECRET)


def _resealed(blob: bytearray, secret_value: str | None) -> bytearray:
    """``blob`` with its payload changed and sealed again under ``secret_value``."""
    forged = bytearray(blob)
    forged[-1] ^= 0x5A  # the forged KV
    forged[6:8] = b"\0\0"  # unsealed: seal_chunk computes a fresh tag
    with secret(secret_value):
        seal_chunk(forged)
    return forged


@pytest.mark.parametrize("attacker", [None, "someone-elses-secret-value"])
def test_a_chunk_resealed_without_the_cluster_secret_is_corrupt(attacker: str | None) -> None:
    """Today's unkeyed checksum anyone can recompute; the tag needs the cluster's key."""
    genuine = encode_chunk(meta("s", 0, 0), kv_tensor(1))
    verify_chunk(genuine)
    forged = _resealed(genuine, attacker)
    with secret(attacker):
        verify_chunk(forged)  # valid as its forger sees it ...
    with pytest.raises(ChunkCorrupt, match="MAC"):
        verify_chunk(forged)  # ... not under the cluster's key
    with pytest.raises(ChunkCorrupt):
        decode_chunk(forged)


def test_the_same_chunk_resealed_with_the_cluster_key_is_accepted() -> None:
    forged = _resealed(encode_chunk(meta("s", 0, 0), kv_tensor(1)), CLUSTER_SECRET)
    verify_chunk(forged)  # (the key is what makes a tag: a cluster member's seal holds)


def test_a_chunk_read_under_another_sessions_key_is_corrupt() -> None:
    """Chunks are genuine, sealed by the cluster, but one sits under the other's key."""
    a, b = meta("session-a", 3, 1), meta("session-b", 3, 1)
    blob_a = encode_chunk(a, kv_tensor(1))
    verify_chunk(blob_a, a.key)
    assert decode_chunk(blob_a, key=a.key).meta == a
    with pytest.raises(ChunkCorrupt, match="stored under"):
        verify_chunk(blob_a, b.key)
    with pytest.raises(ChunkCorrupt):
        decode_chunk(blob_a, key=b.key)
    other_layer = ChunkMeta(a.tenant, a.model_fp, 2, a.block_hashes)
    with pytest.raises(ChunkCorrupt):
        verify_chunk(blob_a, other_layer.key)


def test_a_chunk_relabelled_to_another_tenant_is_corrupt() -> None:
    """Tags are per tenant: a header rewritten to name another tenant, its tag kept,
    verifies under neither tenant's key."""
    m = meta("s", 0, 0)
    blob = encode_chunk(m, kv_tensor(1))
    hlen = _PREAMBLE.unpack_from(blob)[3]
    h = msgpack.unpackb(bytes(blob[PREAMBLE_BYTES : PREAMBLE_BYTES + hlen]))
    h["tenant"] = "t2"
    header = msgpack.packb(h)
    assert len(header) == hlen  # (same length: only the name differs)
    relabelled = bytearray(blob)
    relabelled[PREAMBLE_BYTES : PREAMBLE_BYTES + hlen] = header
    other = ChunkMeta("t2", m.model_fp, m.layer, m.block_hashes)
    with pytest.raises(ChunkCorrupt, match="MAC"):
        verify_chunk(relabelled, other.key)
