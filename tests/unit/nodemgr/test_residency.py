"""The node's default residency report (no Reuse Store yet): an active model is resident
whole, an evicted one by its weight files' bytes the kernel says are in the page cache, and
the load bandwidth is measured from the activations; the heartbeat carries it all."""

from __future__ import annotations

from pathlib import Path

from services.nodemgr import wire
from services.nodemgr.residency import NodeResidency
from services.nodemgr.weight_cache import WeightCache, page_cached_bytes
from shared.model_catalog import ModelEntry
from shared.model_residency import ModelResidency


def model_dir(root: Path, name: str, size: int) -> ModelEntry:
    (root / name).mkdir()
    (root / name / "model.safetensors").write_bytes(b"\x01" * size)
    return ModelEntry(name, str(root / name))


def test_active_models_are_resident_whole_and_evicted_ones_by_the_page_cache(
        tmp_path: Path) -> None:
    a, b = model_dir(tmp_path, "a", 3 * 4096), model_dir(tmp_path, "b", 5 * 4096)
    served = ["a"]
    weights = WeightCache()
    res = NodeResidency((a, b), weights, lambda: served)
    (tmp_path / "b" / "model.safetensors").read_bytes()  # (its pages are in the cache now)
    cached = page_cached_bytes(tmp_path / "b" / "model.safetensors")
    assert cached == 5 * 4096  # (mincore answers on Linux)
    assert res.residency() == [ModelResidency("a", 3 * 4096, 3 * 4096, True),
                               ModelResidency("b", 5 * 4096, 5 * 4096, False)]
    assert res.residency()[1].missing_bytes == 0
    # Where the kernel cannot say, an evicted model counts as not resident at all.
    weights.cached_bytes = lambda entry: None  # type: ignore[method-assign]
    res = NodeResidency((a, b), weights, lambda: served)
    assert res.residency()[1] == ModelResidency("b", 0, 5 * 4096, False)
    weights.close()


def test_the_load_bandwidth_is_measured_from_activations_and_sent_in_each_beat(
        tmp_path: Path) -> None:
    a = model_dir(tmp_path, "a", 8 * 4096)
    res = NodeResidency((a,), WeightCache(), list)
    assert res.load_bytes_per_s() == 0.0  # (nothing measured yet)
    res.loaded("a", 2.0)
    res.loaded("a", 2.0)
    assert res.load_bytes_per_s() == 8 * 4096 / 2.0
    msg = wire.heartbeat("n0", None, 0, "", residency=res)
    assert msg.load_bytes_per_s == 8 * 4096 / 2.0
    (r,) = msg.residency
    assert (r.model, r.total_bytes, r.active) == ("a", 8 * 4096, False)


def test_the_scheduler_keeps_what_a_beat_reports(tmp_path: Path) -> None:
    from services.scheduler import wire as sched_wire
    a = model_dir(tmp_path, "a", 4096)
    res = NodeResidency((a,), WeightCache(), lambda: ["a"])
    res.loaded("a", 0.5)
    node, load = sched_wire.beat(wire.heartbeat("n0", None, 0, "", residency=res))
    assert node == "n0" and load.load_bytes_per_s == 4096 / 0.5
    assert load.residency_of("a") == ModelResidency("a", 4096, 4096, True)
