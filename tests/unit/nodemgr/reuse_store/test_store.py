"""The Reuse Store with real demo models and the engine's mapped loader: shared tensors
held once, re-activation loads nothing, eviction under pressure frees the chosen tensors
and the model reloads with the same bytes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.engine.model import load_model, write_demo_model
from services.engine.model.mapped import StoredTensor, StoredWeights, load_mapped
from services.nodemgr.reuse_store import ReuseStore, ShmArena, index_model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("share")
    return {name: write_demo_model(root / name, "tiny", seed=seed, base_seed=0, share=0.5)
            for name, seed in (("a", 1), ("b", 2))}


@pytest.fixture
def arena(tmp_path: Path) -> Iterator[ShmArena]:
    a = ShmArena(4 << 20, str(tmp_path))
    yield a
    a.close()


def activate(store: ReuseStore, model: str, path: Path) -> tuple[torch.nn.Module, int]:
    plan = store.plan(model)
    stored = StoredWeights(store.arena.path, store.arena.nbytes, store.dtype,
                           tuple(StoredTensor(m.name, m.offset, m.nbytes, m.fill) for m in plan))
    got = load_mapped(path, stored, torch.float32)
    store.committed(model, got.fill_seconds)
    store.check_integrity()
    return got.loaded.model, got.filled_bytes


def same_weights(mapped: torch.nn.Module, path: Path) -> bool:
    plain = dict(load_model(path, dtype=torch.float32).model.named_parameters())
    return all(torch.equal(p, plain[n]) for n, p in mapped.named_parameters() if n in plain)


def test_shared_tensors_are_held_once(models: dict[str, Path], arena: ShmArena) -> None:
    store = ReuseStore(arena, dtype="float32")
    ia, ib = (index_model(m, models[m], "float32") for m in ("a", "b"))
    store.add_index(ia)
    store.add_index(ib)
    shared = set(ia.unique()) & set(ib.unique())
    assert shared and set(ia.unique()) != set(ib.unique())
    ma, _ = activate(store, "a", models["a"])
    mb, filled_b = activate(store, "b", models["b"])
    union = {**ia.unique(), **ib.unique()}
    assert store.resident_bytes() == sum(union.values())
    assert store.shared_bytes() == sum(ia.unique()[k] for k in shared)
    assert filled_b < ib.total_bytes and store.stats.hits >= len(shared)
    # One region per tensor: a shared one is in the arena once, both models map it.
    assert len(store.regions.keys()) == len(union)
    assert same_weights(ma, models["a"]) and same_weights(mb, models["b"])


def test_reactivation_of_a_resident_model_loads_nothing(models: dict[str, Path],
                                                        arena: ShmArena) -> None:
    store = ReuseStore(arena, dtype="float32")
    store.add_index(index_model("a", models["a"], "float32"))
    _, first = activate(store, "a", models["a"])
    assert first > 0
    store.deactivated("a")  # evicted from its engine: inactive but resident
    loaded = store.stats.loaded_bytes
    model, again = activate(store, "a", models["a"])
    assert again == 0 and store.stats.loaded_bytes == loaded
    assert same_weights(model, models["a"])


def test_eviction_under_pressure_frees_the_chosen_tensors(models: dict[str, Path],
                                                          tmp_path: Path) -> None:
    ia, ib = (index_model(m, models[m], "float32") for m in ("a", "b"))
    union = sum({**ia.unique(), **ib.unique()}.values())
    # Room for a, and for b, but not for both: b's activation must evict a's own tensors.
    small = ShmArena(max(ia.total_bytes, ib.total_bytes) + (union - max(
        ia.total_bytes, ib.total_bytes)) // 2 + (64 << 10), str(tmp_path))
    try:
        store = ReuseStore(small, dtype="float32")
        store.add_index(ia)
        store.add_index(ib)
        activate(store, "a", models["a"])
        store.deactivated("a")
        only_a = set(ia.unique()) - set(ib.unique())
        mb, _ = activate(store, "b", models["b"])
        gone = {k for k in only_a if store.regions.find(k) is None}
        assert gone and store.stats.evictions == len(gone)
        assert all(store.regions.find(k) is not None for k in ib.unique())  # b is pinned
        assert same_weights(mb, models["b"])
        store.deactivated("b")
        ma, refilled = activate(store, "a", models["a"])  # a comes back: reload what went
        assert refilled >= sum(ia.unique()[k] for k in gone)
        assert same_weights(ma, models["a"])
    finally:
        small.close()
