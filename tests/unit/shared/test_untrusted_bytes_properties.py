"""Property tests (hypothesis) of everything that parses bytes or JSON from outside: the
chunk codec, the manifest codec and the public API's request validation. Garbage never
crashes them (only their own, declared errors), and never yields data."""

from __future__ import annotations

import json

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.kvstore.manifests.manifest import Manifest, sealed_manifest
from services.scheduler.api import ApiError, Limits, parse_json, validate
from shared.chunk_codec import (
    ChunkCorrupt,
    ChunkFormatError,
    decode_chunk,
    encode_chunk,
    read_meta,
)
from tests.unit.kvstore.chunks import kv_tensor, meta

FAST = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
SEALED = bytes(encode_chunk(meta("s", 3, 1, blocks=2), kv_tensor(7)))


@FAST
@given(st.binary(max_size=4096))
def test_garbage_is_never_a_chunk(blob: bytes) -> None:
    for parse in (decode_chunk, read_meta):
        try:
            parse(blob)
        except (ChunkCorrupt, ChunkFormatError):
            continue
        raise AssertionError(f"{parse.__name__} accepted garbage")


@FAST
@given(st.integers(min_value=0, max_value=len(SEALED) - 1), st.integers(1, 255))
def test_one_changed_byte_of_a_sealed_chunk_is_always_caught(at: int, flip: int) -> None:
    damaged = bytearray(SEALED)
    damaged[at] ^= flip
    try:
        decode_chunk(damaged)
    except (ChunkCorrupt, ChunkFormatError):
        return
    raise AssertionError(f"a chunk with byte {at} changed decoded")


_json_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
JSON = st.recursive(_json_leaf, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)
_MANIFEST_KEYS = ("tenant", "session_id", "model_fp", "hashes", "tokens", "layers", "bpc",
                  "updated")
_msgpack_leaf = (st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
                 | st.floats(allow_nan=False) | st.text() | st.binary(max_size=40))
MSGPACK = st.recursive(_msgpack_leaf, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.sampled_from(_MANIFEST_KEYS), inner, max_size=8),
                       max_leaves=30)


@FAST
@given(st.binary(max_size=512) | MSGPACK.map(lambda v: msgpack.packb(v)))
def test_garbage_is_never_a_manifest(data: bytes) -> None:
    """Garbage fails the MAC; garbage with a valid MAC (a cluster member's bug) must still
    parse into a whole, valid manifest or be refused."""
    with pytest.raises(ChunkFormatError):
        Manifest.decode(data, "t/s")
    try:
        m = Manifest.decode(sealed_manifest("t/s", data), "t/s")
    except ChunkFormatError:
        return
    # (a random structure that happens to be well-formed must be a whole, valid manifest)
    assert Manifest.decode(m.encode(), "t/s") == m


def test_a_manifest_round_trips() -> None:
    m = Manifest("t", "s", "fp", (b"\1" * 16, b"\2" * 16), 40, 2, 1, 12.5)
    assert Manifest.decode(m.encode(), "t/s") == m


_FIELDS = ("model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n",
           "seed", "stop", "stop_token_ids", "stream", "stream_options", "session_id",
           "priority", "return_token_ids", "logprobs", "tools", "response_format")
_message = st.fixed_dictionaries({"role": st.sampled_from(
    ("system", "developer", "user", "assistant", "tool", "x")), "content": JSON})
BODIES = st.dictionaries(st.sampled_from(_FIELDS), JSON | st.lists(_message, max_size=3),
                         max_size=8)


@FAST
@given(BODIES, st.sampled_from(("chat", "completion")))
def test_any_body_is_a_request_or_a_400(body: dict, endpoint: str) -> None:
    try:
        req = validate(body, endpoint, Limits(), session_header="")  # type: ignore[arg-type]
    except ApiError as e:
        assert 400 <= e.status < 500 and e.body()["error"]["message"]
        return
    assert req.prompts and req.n >= 1


@FAST
@given(st.binary(max_size=256) | JSON.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_are_a_json_object_or_a_400(raw: bytes) -> None:
    try:
        body = parse_json(raw)
    except ApiError as e:
        assert e.status == 400
        return
    assert isinstance(body, dict)
