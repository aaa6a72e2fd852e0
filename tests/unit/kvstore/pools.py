"""A real engine KV pool (shared-memory file, services/engine/kv_pool.py) for kvstore tests.

Block layout used by the tests: sequence block i of layer l sits in pool block
``base + l * stride + i`` (layer-major, like the engine's requests).
"""

from __future__ import annotations

import hashlib

import torch

from services.engine.kvcache.device_memory import DeviceMemory, block_bytes_for
from services.kvstore.engine_path.attach import PoolGeometry

TENANT = "t1"
MODEL = "fp0"
BLOCK = 16
HEADS = 2
DIM = 8
LAYERS = 3
CHUNK_TOKENS = 256  # 16 blocks per chunk


def make_pool(num_blocks: int = 512) -> DeviceMemory:
    bb = block_bytes_for(BLOCK, HEADS, DIM, torch.float32)
    pool = DeviceMemory(
        block_size=BLOCK, num_kv_heads=HEADS, head_dim=DIM, dtype=torch.float32,
        budget_bytes=num_blocks * bb, page_bytes=64 * bb,
    )
    while pool.grow() is not None:
        pass
    return pool


def geometry(pool: DeviceMemory, layers: int = LAYERS, model_fp: str = MODEL) -> PoolGeometry:
    return PoolGeometry(
        pool_name=pool.name, device="cpu", num_blocks=pool.num_blocks, block_size=BLOCK,
        num_kv_heads=HEADS, head_dim=DIM, dtype="float32", num_layers=layers, model_fp=model_fp,
    )


def hashes(n: int, tag: str = "s", diverge_at: int | None = None) -> tuple[bytes, ...]:
    """A chained-looking hash list; from ``diverge_at`` on it differs from the untagged one."""
    out = []
    prev = b"seed"
    for i in range(n):
        salt = b"edited" if diverge_at is not None and i >= diverge_at else b""
        prev = hashlib.blake2b(prev + tag.encode() + salt + i.to_bytes(4, "little"),
                               digest_size=16).digest()
        out.append(prev)
    return tuple(out)


def ids(first: int, count: int, base: int, stride: int, layers: int = LAYERS) -> list[int]:
    """Layer-major pool block ids of sequence blocks [first, first + count)."""
    return [
        base + layer * stride + i for layer in range(layers) for i in range(first, first + count)
    ]


def fill(pool: DeviceMemory, block_ids: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    shape = (len(block_ids), *pool.kv_cache.shape[1:])
    pool.kv_cache[block_ids] = torch.randn(shape, generator=g)
