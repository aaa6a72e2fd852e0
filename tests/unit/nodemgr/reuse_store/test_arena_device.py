"""The nodemgr's side of the weight arena's device seam: the arena follows the engines'
device (``nodemgr.weights_device``). CPU gets the shared-memory file and never loads the
CUDA arena's module or cuda-python; CUDA gets the VMM arena (a stand-in here: no GPU),
serving its handles on a socket its path names, as the engine's ``map_weight_arena``
expects; anything else is refused naming the key."""

from __future__ import annotations

import asyncio
import importlib
import sys
from contextlib import AsyncExitStack
from pathlib import Path
from types import ModuleType

import pytest

from services.engine.cuda_weights import parse_path
from services.nodemgr.config import NodeManagerConfig
from services.nodemgr.reuse_store import ShmArena, arena
from services.nodemgr.reuse_store.setup import open_store


class FakeCudaArena:
    """CudaVmmArena's surface without the driver: records how it was opened."""

    def __init__(self, nbytes: int, device_index: int = 0) -> None:
        self.nbytes, self.device_index = nbytes, device_index
        self.path = f"cuda:{device_index}"
        self.closed = False

    def serve_handles(self, sock_path: str) -> None:
        self.path = f"{self.path}@{sock_path}"

    def close(self) -> None:
        self.closed = True


def _cuda_arena() -> ModuleType:
    """The CUDA arena's module as ``open_arena`` will import it: the one in ``sys.modules``
    (a test here drops it from there, so the package's attribute may name a stale copy)."""
    return importlib.import_module("services.nodemgr.reuse_store.cuda_arena")


def test_a_cpu_node_gets_the_shared_memory_file(tmp_path: Path) -> None:
    sys.modules.pop("services.nodemgr.reuse_store.cuda_arena", None)
    a = arena.open_arena("cpu", 1 << 20, str(tmp_path), "node-7")
    try:
        assert isinstance(a, ShmArena) and Path(a.path).parent == tmp_path
        assert a.nbytes == 1 << 20
    finally:
        a.close()
    assert "services.nodemgr.reuse_store.cuda_arena" not in sys.modules
    assert "cuda.bindings" not in sys.modules and "cuda.cuda" not in sys.modules


@pytest.mark.parametrize(("device", "index"), [("cuda", 0), ("cuda:1", 1)])
def test_a_cuda_node_gets_the_vmm_arena_serving_its_handles(
        device: str, index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cuda_arena(), "CudaVmmArena", FakeCudaArena)
    a = arena.open_arena(device, 1 << 20, str(tmp_path), "node-7")
    assert isinstance(a, FakeCudaArena) and (a.nbytes, a.device_index) == (1 << 20, index)
    got_index, sock = parse_path(a.path)  # (what the engine's map_weight_arena parses)
    assert got_index == index and Path(sock).parent == tmp_path and "node-7" in sock


def test_the_store_opens_the_arena_of_the_configured_device(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cuda_arena(), "CudaVmmArena", FakeCudaArena)

    async def opened(device: str) -> tuple[str, bool]:
        cfg = NodeManagerConfig(reuse_store_bytes=1 << 20, reuse_store_dir=str(tmp_path),
                                weights_device=device, weights_dtype="float32")
        async with AsyncExitStack() as stack:
            store = await open_store(cfg, (), stack)
            kind = type(store.arena).__name__
        return kind, getattr(store.arena, "closed", True)

    assert asyncio.run(opened("cpu"))[0] == "ShmArena"
    assert asyncio.run(opened("cuda")) == ("FakeCudaArena", True)  # (closed with the stack)


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cpu:1"])
def test_other_devices_are_refused_naming_the_key(device: str) -> None:
    with pytest.raises(ValueError, match="nodemgr.weights_device"):
        arena.open_arena(device, 1 << 20)
