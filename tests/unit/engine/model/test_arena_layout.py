"""Float32 weights oneDNN computes are held in the node's weight arena in oneDNN's layout
(arena_layout.py): a model mapped from the arena computes with exactly the bits of one
loaded privately (which packs them), at one row as at many, whether it filled the arena
or found the tensors resident; weights MKL computes stay plain views; nothing is copied."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.engine.model import demo_model, load_model, write_demo_model
from services.engine.model.arena_layout import ArenaLayouts
from services.engine.model.linear import small_gemm_rows_invariant
from services.engine.model.llama import LlamaModel
from services.engine.model.mapped import StoredTensor, StoredWeights, load_mapped
from services.nodemgr.reuse_store import ReuseStore, ShmArena, index_model

from .paged import PagedCache

# Wide enough that some linears pass SMALL_GEMM_ELEMS (gate_up 1536x256, down 256x768, the
# head 1024x256: oneDNN, packed) and others do not (o 256x256, qkv 512x256: MKL, plain).
WIDE = demo_model.DemoSize(256, 2, 4, 2, 768, 1024, 4096, 3000, torch.float32)


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(demo_model.SIZES, "wide", WIDE)
        yield write_demo_model(tmp_path_factory.mktemp("wide") / "m", "wide", seed=3)


@pytest.fixture
def one_thread() -> Iterator[None]:
    # (as the multi-model engines run: small weights then go to MKL in both loads)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def activate(store: ReuseStore, path: Path, layouts: ArenaLayouts) -> tuple[LlamaModel, int]:
    plan = store.plan("m")
    got = load_mapped(path, StoredWeights(store.arena.path, store.arena.nbytes, store.dtype, tuple(
        StoredTensor(t.name, t.offset, t.nbytes, t.fill) for t in plan)), torch.float32,
        layouts=layouts)
    store.committed("m", got.fill_seconds)
    return got.loaded.model, got.filled_bytes


def steps(model: LlamaModel, prompt: list[int], n: int) -> list[torch.Tensor]:
    """The logits of a prompt and of ``n`` one-row decode steps after it, greedy."""
    cache = PagedCache(model, 1, len(prompt) + n)
    out = [cache.step([prompt], [0])]
    for i in range(n):
        out.append(cache.step([[int(out[-1][0].argmax())]], [len(prompt) + i]))
    return out


def test_mapped_weights_compute_the_bits_of_a_private_load(wide: Path, tmp_path: Path,
                                                          one_thread: None) -> None:
    plain = load_model(wide, dtype=torch.float32).model
    arena = ShmArena(32 << 20, str(tmp_path))
    try:
        store = ReuseStore(arena, dtype="float32")
        store.add_index(index_model("m", wide, "float32"))
        layouts = ArenaLayouts()
        filled, first = activate(store, wide, layouts)
        assert first > 0
        # Every linear here is oneDNN's (MKL fails the row-invariance check at these
        # shapes on this CPU, see test_the_rule): each is packed in the arena, no private
        # copy (its bytes are not the model's own).
        assert all(lin._arena is not None for lin in filled.linears())
        assert filled.weight_bytes == plain.weight_bytes - sum(
            lin.weight.numel() * 4 for lin in filled.linears())
        prompt = list(range(5, 45))
        want = steps(plain, prompt, 6)
        assert all(torch.equal(a, b) for a, b in zip(steps(filled, prompt, 6), want,
                                                       strict=True))
        store.deactivated("m")
        del filled
        # Resident now: mapped again without writing a byte, the same bits.
        again, refilled = activate(store, wide, ArenaLayouts())
        assert refilled == 0
        assert all(torch.equal(a, b) for a, b in zip(steps(again, prompt, 6), want,
                                                       strict=True))
        for lin in again.linears():  # (no copy: the packed weight's bytes are the arena's)
            if lin._arena is not None:
                assert lin._packed is not None
                assert torch.ops.mkldnn.data_ptr(lin._packed) == lin._arena.data_ptr()
    finally:
        arena.close()


def test_the_rule(one_thread: None) -> None:
    """Packed: a float32 linear weight oneDNN computes in every engine whose layout fits its
    region; plain: a padded layout, a lookup table, half precision, and a weight a
    one-thread engine gives MKL (whatever this engine's threads)."""
    layouts = ArenaLayouts()
    assert not layouts.applies("lm_head", (3000, 64), torch.float32)  # (pads to 3008 rows)
    assert not layouts.applies("embed", (1024, 256), torch.float32)  # (a lookup table)
    assert not layouts.applies("layers.0.down_w", (256, 768), torch.bfloat16)
    assert layouts.applies("layers.0.down_w", (256, 768), torch.float32)
    for shape in ((64, 64), (128, 64), (192, 64), (256, 256), (512, 256)):
        mkl = small_gemm_rows_invariant(torch.randn(shape), None)
        assert layouts.applies("layers.0.o_w", shape, torch.float32) is not mkl, shape
        torch.set_num_threads(2)  # (an engine with more threads decides alike)
        assert ArenaLayouts().applies("layers.0.o_w", shape, torch.float32) is not mkl
        torch.set_num_threads(1)
