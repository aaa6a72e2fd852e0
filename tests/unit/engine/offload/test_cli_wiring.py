"""`overture up` wires each node's engine to its own kvstore, whose SSD tier is on, and every
kvstore to the cluster's one S3 server."""

from __future__ import annotations

from pathlib import Path

from services.local_cluster import cluster_specs


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


def test_the_s3_server_starts_first_stops_last_and_every_kvstore_uses_it(tmp_path: Path) -> None:
    from bench.harness import cluster_s3_credentials
    from services.s3_server import s3_server_spec

    s3 = s3_server_spec(tmp_path / "s3", cluster_s3_credentials())
    specs, _ = cluster_specs(nodes=2, http_port=18000, model_path="m", dtype=None, config=None,
                             s3=s3, served_name="smollm2-135m-instruct")
    first = specs[0]
    assert first.name == "s3" and first.stop_last and first.ready is not None
    command = " ".join(first.argv)  # (weed runs under a shell that sets its umask)
    assert " mini " in command and f"-s3.port={s3.ports['s3']}" in command
    assert len(set(s3.ports.values())) == 5
    for node in ("node0", "node1"):
        kv = next(s.argv for s in specs if s.name == f"{node}.kvstore")
        assert flag(kv, "--s3.endpoint-url") == s3.endpoint_url
        assert flag(kv, "--s3.bucket") == "overture-kv"
        eng = next(s.argv for s in specs if s.name == f"{node}.engine")
        assert flag(eng, "--served-model-name") == "smollm2-135m-instruct"
    assert not any(s.stop_last for s in specs[1:])
