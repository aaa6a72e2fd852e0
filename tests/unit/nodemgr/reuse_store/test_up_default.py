"""``overture up`` turns the Reuse Store on where a node may serve several models: sized
to the node's device budget, in the engines' float dtype; off for quantized engines and
when the config sets it; and the scheduler is told the catalogue, so an evicted model's
request reaches a node that activates it (through the store)."""

from __future__ import annotations

from pathlib import Path

from services.local_cluster import cluster_specs, reuse_store_flags


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_on_for_float_engines_sized_to_the_node_budget() -> None:
    flags, why = reuse_store_flags("float32", 1 << 30, None)
    assert flags == {"reuse_store_bytes": 1 << 30, "weights_dtype": "float32"}
    assert why.startswith("Reuse Store: on")


def test_off_for_quantized_engines_and_when_the_config_decides(tmp_path: Path) -> None:
    for dtype in ("q4", "q8_0"):
        flags, why = reuse_store_flags(dtype, 1 << 30, None)
        assert flags == {} and why.startswith("Reuse Store: off")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("nodemgr:\n  reuse_store_bytes: 0\n")
    assert reuse_store_flags("float32", 1 << 30, str(cfg))[0] == {}


def test_only_nodes_with_a_catalogue_get_it_and_the_scheduler_learns_the_catalogue() -> None:
    store, _ = reuse_store_flags("float32", 1 << 30, None)
    specs, _ = cluster_specs(nodes=1, http_port=18000, model_path="m", dtype="float32",
                             config=None, models_config="models.yaml", reuse_store=store)
    by = {s.name: s.argv for s in specs}
    assert flag(by["node0.nodemgr"], "--reuse-store-bytes") == str(1 << 30)
    assert flag(by["node0.nodemgr"], "--weights-dtype") == "float32"
    assert flag(by["scheduler"], "--models-config") == "models.yaml"
    plain, _ = cluster_specs(nodes=1, http_port=18000, model_path="m", dtype="q4",
                             config=None, reuse_store=store)
    by = {s.name: s.argv for s in plain}
    assert flag(by["node0.nodemgr"], "--reuse-store-bytes") is None
    assert flag(by["scheduler"], "--models-config") is None
