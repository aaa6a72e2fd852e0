"""What the engine-pool path tests share: block layouts and save/lookup/load helpers."""

from __future__ import annotations

from pathlib import Path

from services.kvstore.engine_path.data_path import EnginePoolPath
from services.kvstore.engine_path.types import LoadRequest, LookupRequest, SaveRequest
from services.kvstore.metrics import KVStoreMetrics
from services.kvstore.store import TieredStore
from services.kvstore.tiers import DramTier, SsdTier
from shared.kv_layout import StoredPrefix
from tests.unit.kvstore.pools import (
    LAYERS,
    MODEL,
    TENANT,
    fill,
    ids,
)

STRIDE = 64  # pool blocks per layer in the tests' layouts


SRC, DST = 0, 256  # bases of the saved and the loaded blocks


def make_store(tmp_path: Path, dram: int = 1 << 24, ssd: bool = True) -> TieredStore:
    tiers = [DramTier(dram)]
    if ssd:
        tiers.append(SsdTier(str(tmp_path / "db"), 1 << 24))
    return TieredStore(tiers, KVStoreMetrics(), retry_backoff_max_s=0.02, drain_s=0.5)


async def save(
    dp: EnginePoolPath, pid: str, hs: tuple[bytes, ...], first: int = 0, session: str = "sess"
) -> tuple[int, int]:
    n = len(hs) - first
    r = await dp.save(
        SaveRequest(
            pid,
            TENANT,
            session,
            MODEL,
            hs,
            len(hs) * 16 + 3,
            first,
            tuple(ids(first, n, SRC, STRIDE)),
            LAYERS,
        )
    )
    return r.chunks_written, r.chunks_skipped


async def lookup(
    dp: EnginePoolPath, hs: tuple[bytes, ...], first: int = 0, session: str = "sess"
) -> StoredPrefix:
    return await dp.lookup(LookupRequest(TENANT, session, MODEL, hs, first, LAYERS))


async def load(dp: EnginePoolPath, pid: str, r: StoredPrefix, dst_ids: list[int]) -> list:
    req = LoadRequest(pid, r.lease_id, TENANT, MODEL, tuple(r.spans), tuple(dst_ids), LAYERS)
    return [m async for m in dp.load(req)]


def spans_of(r: StoredPrefix) -> list[tuple[int, int]]:
    return [(s.first_block, s.use_blocks) for s in r.spans]


async def durable(dp: EnginePoolPath) -> None:
    await dp.wait_manifests()
    await dp.store.writer.close(5.0)  # drain the write-behind
    await dp.store.writer.start()


def path_store_empty(store: TieredStore) -> bool:
    return store.stats()[0].entries == 0


def _into_the_pool(offset: int, bufs: list) -> bool:
    """Whether a ``FileStored.readinto`` reads a payload into pool blocks: a chunk the lease
    named is read whole, its head into one buffer and the payload into the blocks after;
    another has its payload read from past its head. (One buffer from 0: a head or a
    whole blob.)"""
    return offset > 0 or len(bufs) > 1


async def _ssd_only(path: EnginePoolPath, pid: str, pool, hs: tuple[bytes, ...], seed: int):
    """Save ``hs`` from the SRC blocks, wait until durable, drop every DRAM copy."""
    fill(pool, ids(0, len(hs), SRC, STRIDE), seed=seed)
    saved = pool.kv_cache.clone()
    await save(path, pid, hs)
    await durable(path)
    for key in path.store.dram._index.keys():
        await path.store.dram.delete(key)
    pool.kv_cache[DST:].zero_()
    return saved


def _repacked(blob: bytes, **fields) -> bytes:
    """``blob`` with its header map packed in another key order (as another encoder may
    write it) and ``fields`` replaced; sealed, payload unchanged."""
    import msgpack

    from shared.chunk_codec import _PREAMBLE, FORMAT_VERSION, PREAMBLE_BYTES, parse_head, seal_chunk

    head = parse_head(blob, len(blob))
    hlen = _PREAMBLE.unpack_from(blob)[3]
    h = msgpack.unpackb(blob[PREAMBLE_BYTES : PREAMBLE_BYTES + hlen])
    h.update(fields)
    header = msgpack.packb(dict(sorted(h.items())))
    out = bytearray(_PREAMBLE.pack(b"OVKC", FORMAT_VERSION, 0, len(header), b"")) + header
    out += bytes(-len(out) % 64) + blob[head.payload_offset :]
    seal_chunk(out)
    return bytes(out)
