"""`overture up` wires each node's engine to its own kvstore, whose SSD tier is on."""

from __future__ import annotations

from pathlib import Path

from services.cli import cluster_specs


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_each_engine_gets_its_nodes_kvstore_and_an_ssd_path() -> None:
    specs, _ = cluster_specs(nodes=2, http_port=18000, model_path="m", dtype=None, config=None,
                             state_dir=Path(".overture"))
    by_name = {s.name: s.argv for s in specs}
    for node in ("node0", "node1"):
        kv, eng = by_name[f"{node}.kvstore"], by_name[f"{node}.engine"]
        assert flag(eng, "--offload.kvstore-address").endswith(":" + flag(kv, "--port"))
        assert flag(kv, "--ssd-path") == str(Path(".overture") / node / "kvstore-ssd")


def test_no_state_dir_leaves_the_ssd_path_to_the_config() -> None:
    specs, _ = cluster_specs(nodes=1, http_port=18000, model_path="m", dtype=None, config=None)
    assert "--ssd-path" not in specs[1].argv
