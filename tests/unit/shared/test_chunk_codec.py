from __future__ import annotations

import pytest
import torch

from shared.chunk_codec import (
    ChunkCorrupt,
    ChunkFormatError,
    ChunkMeta,
    StorageError,
    decode_chunk,
    encode_chunk,
    is_sealed,
    read_meta,
    seal_chunk,
    verify_chunk,
)
from tests.unit.kvstore.chunks import forged_chunk, kv_tensor, meta


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn]
)
def test_roundtrip_exact(dtype: torch.dtype) -> None:
    t = (kv_tensor(1) * 10).to(dtype)
    m = meta("s", 3, layer=5, blocks=2)
    blob = encode_chunk(m, t)
    c = decode_chunk(blob)
    assert c.meta == m
    assert c.tensor.dtype == dtype and c.tensor.shape == t.shape
    assert torch.equal(c.tensor, t)


def test_decode_views_the_blob_without_copy() -> None:
    blob = encode_chunk(meta("s", 0, 0), kv_tensor(2))
    c = decode_chunk(blob)
    base = torch.frombuffer(blob, dtype=torch.uint8).data_ptr()
    assert base <= c.tensor.data_ptr() < base + len(blob)


def test_key_names_tenant_model_last_block_and_layer() -> None:
    m = meta("s", 7, layer=3, blocks=4)
    assert m.key == f"t1/fp0/{m.block_hashes[-1].hex()}/3"


@pytest.mark.parametrize("where", ["header", "payload", "last"])
def test_flipped_byte_is_corrupt_not_a_miss(where: str) -> None:
    blob = encode_chunk(meta("s", 0, 0), kv_tensor(3))
    pos = {"header": 20, "payload": len(blob) // 2, "last": len(blob) - 1}[where]
    blob[pos] ^= 0x40
    with pytest.raises(ChunkCorrupt) as e:
        decode_chunk(blob)
    assert isinstance(e.value, StorageError)


def test_truncated_and_garbage_are_corrupt() -> None:
    blob = encode_chunk(meta("s", 0, 0), kv_tensor(3))
    for bad in (blob[:10], blob[:-4], b"x" * 64):
        with pytest.raises(ChunkCorrupt):
            decode_chunk(bytes(bad))


def test_deferred_seal() -> None:
    blob = encode_chunk(meta("s", 0, 1), kv_tensor(4), seal=False)
    assert not is_sealed(blob)
    with pytest.raises(ChunkCorrupt):
        verify_chunk(blob)
    assert torch.equal(decode_chunk(blob, verify=False).tensor, kv_tensor(4))
    seal_chunk(blob)
    seal_chunk(blob)  # idempotent
    assert is_sealed(blob)
    verify_chunk(blob)
    assert read_meta(blob).layer == 1


def test_bad_input_is_a_typed_error() -> None:
    with pytest.raises(ChunkFormatError):
        encode_chunk(ChunkMeta("a/b", "fp", 0, (b"h",)), kv_tensor(0))
    with pytest.raises(ChunkFormatError):
        encode_chunk(ChunkMeta("t", "fp", 0, ()), kv_tensor(0))
    with pytest.raises(ChunkFormatError):
        encode_chunk(ChunkMeta("t", "fp", -1, (b"h",)), kv_tensor(0))
    with pytest.raises(ChunkFormatError):
        encode_chunk(meta("s", 0, 0), torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ChunkFormatError):  # only the last hash is checked by the key
        encode_chunk(ChunkMeta("t", "fp", 0, ("text", b"h")), kv_tensor(0))  # type: ignore[arg-type]


def test_non_contiguous_tensor_is_stored_in_logical_order() -> None:
    t = kv_tensor(5).transpose(1, 2)  # (2, heads, tokens, dim), a strided view
    c = decode_chunk(encode_chunk(meta("s", 0, 0), t))
    assert torch.equal(c.tensor, t)


def test_views_with_an_offset_and_grad_tensors_store_their_own_bytes() -> None:
    base = kv_tensor(6)
    view = base[1:]  # starts past the beginning of its storage
    assert torch.equal(decode_chunk(encode_chunk(meta("s", 0, 0), view)).tensor, view)
    leaf = kv_tensor(7).float().requires_grad_()
    assert torch.equal(decode_chunk(encode_chunk(meta("s", 0, 0), leaf)).tensor, leaf.detach())


def test_header_is_one_map_of_every_field() -> None:
    import msgpack

    from shared.chunk_codec import _PREAMBLE, PREAMBLE_BYTES

    m = meta("s", 3, layer=200, blocks=17)  # a multi-byte layer and an array16 of hashes
    t = kv_tensor(8)
    blob = encode_chunk(m, t)
    hlen = _PREAMBLE.unpack_from(blob)[3]
    assert msgpack.unpackb(bytes(blob[PREAMBLE_BYTES : PREAMBLE_BYTES + hlen])) == {
        "tenant": m.tenant, "model_fp": m.model_fp, "layer": 200, "hashes": list(m.block_hashes),
        "dtype": "float32", "shape": list(t.shape), "nbytes": t.numel() * 4,
    }


def test_cached_header_parts_give_each_chunk_its_own_header_from_any_thread() -> None:
    """The per-layout header cache and the per-thread packer: chunks of differing tail
    lengths (layer and hash count) and tenants, encoded on several threads at once, each
    decode to exactly their own meta; the cache stays bounded under many names."""
    from concurrent.futures import ThreadPoolExecutor

    from shared import chunk_codec

    cases = [(meta(f"s{i % 3}", i, layer=(i * 37) % 300, blocks=1 + i % 20), kv_tensor(i % 4))
             for i in range(64)]
    with ThreadPoolExecutor(4) as executor:
        blobs = list(executor.map(lambda c: encode_chunk(*c), cases * 4))
    for (m, t), blob in zip(cases * 4, blobs, strict=True):
        c = decode_chunk(blob)
        assert c.meta == m and torch.equal(c.tensor, t)
    for i in range(chunk_codec._MAX_LAYOUTS + 10):
        encode_chunk(ChunkMeta(f"tenant{i}", "fp", 0, (b"h",)), kv_tensor(0))
    assert len(chunk_codec._LAYOUTS) <= chunk_codec._MAX_LAYOUTS
    for n in range(1, 17):  # one layout, a header tail of every length hashes can give
        for size in range(1, 65):
            encode_chunk(ChunkMeta("t", "fp", 0, (b"h" * size,) * n), kv_tensor(0))
    assert len(chunk_codec._PREFIXES) <= chunk_codec._MAX_PREFIXES


def test_every_block_hash_is_bounded_as_a_read_bounds_it() -> None:
    """A hash a read would refuse (over 64 bytes) is refused when encoding too, wherever it
    sits in the chunk: nothing written can be unreadable."""
    for hashes in ((b"x" * 65, b"y"), (b"y", b"x" * 65)):
        with pytest.raises(ChunkFormatError, match="64"):
            encode_chunk(ChunkMeta("t", "fp", 0, hashes), kv_tensor(0))


def test_an_expected_head_matches_exactly_that_sealed_chunk() -> None:
    """``ExpectedHead.match`` recognises the head ``encode_chunk`` wrote for one chunk,
    sealed, as ``parse_head`` reads it; any other head or size is not a match."""
    from shared.chunk_codec import ExpectedHead, parse_head

    m, t = meta("s", 20, layer=200, blocks=16), kv_tensor(3, tokens=16)
    blob = encode_chunk(m, t)
    want = ExpectedHead(m, "float32", tuple(t.shape))
    head = blob[: want.payload_offset]
    assert want.match(head, len(blob)) == parse_head(blob, len(blob))
    assert want.match(head, len(blob) + 1) is None  # the payload's length
    assert want.match(head[:-1], len(blob)) is None  # not the whole head
    assert want.match(encode_chunk(m, t, seal=False)[: want.payload_offset], len(blob)) is None
    flagged = bytearray(head)
    flagged[6] |= 2  # a flag this reader does not know
    assert want.match(flagged, len(blob)) is None
    others = [
        ChunkMeta(m.tenant, m.model_fp, 201, m.block_hashes),
        ChunkMeta("other", m.model_fp, 200, m.block_hashes),
        ChunkMeta(m.tenant, "fp-other", 200, m.block_hashes),
        meta("s", 20, layer=200, blocks=15),
        meta("edited", 20, layer=200, blocks=16),
    ]
    for other in others:
        blob2 = encode_chunk(other, t)
        assert want.match(blob2[: want.payload_offset], len(blob2)) is None, other
    # the same payload length in another dtype and shape; another length
    for shape, dtype in (((16, 2, 4, 2, 8), "float16"), ((8, 2, 8, 2, 8), "float32")):
        other_want = ExpectedHead(m, dtype, shape)
        assert other_want.match(head, len(blob)) is None


def test_negated_views_store_their_values() -> None:
    t = kv_tensor(9)
    neg = torch._neg_view(t)  # a lazily negated view over t's memory
    assert neg.is_neg()
    assert torch.equal(decode_chunk(encode_chunk(meta("s", 0, 0), neg)).tensor, -t)


@pytest.mark.parametrize("fields", [
    {"hashes": []},  # names no block: was an IndexError
    {"hashes": [12345]},  # an integer: bytes(n) would have made n zero bytes
    {"hashes": [b"x" * 65]},  # longer than any hash: a huge key
    {"tenant": "a/b"},  # a name chunk_key refuses
    {"model_fp": 7},
    {"layer": 2**63},  # would overflow where layers are 32-bit
    {"layer": -1},
    {"layer": "3"},
])
def test_a_malformed_header_is_corrupt_whatever_the_field(fields: dict) -> None:
    """Headers from peers and clients are untrusted: any field that encode_chunk would
    have refused makes the chunk corrupt (a clean miss), never another exception."""
    from shared.chunk_codec import parse_head

    forged = forged_chunk(**fields)
    with pytest.raises(ChunkCorrupt):  # (its MAC fits: only the form is wrong)
        verify_chunk(forged)
    with pytest.raises(ChunkCorrupt):
        parse_head(forged, len(forged))
    with pytest.raises(ChunkCorrupt):
        read_meta(forged)
    with pytest.raises(ChunkCorrupt):
        decode_chunk(forged)
