"""``overture up``: starts the whole cluster, serves, and stops every child on Ctrl-C."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from services.local_cluster import free_port
from tests.cluster import REPO, Cluster


def _reader(stream, lines: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        lines.put(line)
    lines.put(None)


@pytest.mark.slow
def test_up_serves_and_stops_cleanly(tiny_model: Path, tmp_path: Path) -> None:
    """Up, ready, serving a chat turn and every service's /metrics (listed in the
    discovery file and by GET /admin/nodes); Ctrl-C stops every child."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            "--port",
            str(port),
            "--model",
            str(tiny_model),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not any("Overture is ready at" in s for s in seen):
            assert time.monotonic() < deadline, "".join(seen[-60:])
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "overture up exited early:\n" + "".join(seen[-60:])
            seen.append(line)
        api = Cluster(url=f"http://127.0.0.1:{port}", log_dir=tmp_path)
        assert any(line.startswith("[node0.engine] ") for line in seen)
        assert any(line.startswith("[scheduler] ") for line in seen)
        # The cluster's S3 server is up, and every kvstore has it as its lowest tier.
        assert any(line.startswith("[s3] ") for line in seen)
        assert any("tiers: dram, ssd, s3" in line for line in seen), "".join(seen[-60:])
        models = api.get("/v1/models")[1]["data"]
        status, answer = api.post(
            "/v1/chat/completions",
            {
                "model": models[0]["id"],
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            },
        )
        assert status == 200, answer
        _every_service_serves_its_metrics(api, tmp_path / ".overture")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        try:
            api.get("/healthz", timeout=2)
            raise AssertionError("the scheduler still answers after overture up stopped")
        except OSError:
            pass
        s3_dir = str((tmp_path / ".overture" / "s3").resolve())
        left = subprocess.run(["pgrep", "-f", s3_dir], capture_output=True)
        assert left.returncode == 1, "the S3 server outlived overture up"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _every_service_serves_its_metrics(api: Cluster, state: Path) -> None:
    groups = json.loads((state / "prometheus-targets.json").read_text())
    seen = {(g["labels"].get("node", ""), g["labels"]["service"]): g["targets"][0]
            for g in groups}
    listed = api.get("/admin/nodes")[1]["nodes"]
    nodes = sorted(n["node"] for n in listed)
    assert nodes and set(seen) == {("", "scheduler"), *(
        (node, s) for node in nodes for s in ("kvstore", "engine", "nodemgr"))}
    for (node, service), target in seen.items():
        with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert r.status == 200 and "# TYPE " in text, (node, service)
    # (the kvstore's bytes per tier are what the evaluation's runner scrapes)
    names = {"kvstore": "kvstore_bytes_out", "engine": "overture_engine_",
             "nodemgr": "overture_nodemgr_"}
    for (node, service), target in seen.items():
        if service in names:
            with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as r:
                assert names[service] in r.read().decode(), (node, service)
    assert {n["node"]: n["metrics"] for n in listed} == {
        node: {s: f"http://{seen[(node, s)]}/metrics" for s in ("kvstore", "engine", "nodemgr")}
        for node in nodes}


def test_help_everywhere(capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import main

    for args in ([], ["up"], ["demo-model"]):
        with pytest.raises(SystemExit) as e:
            main([*args, "--help"])
        assert e.value.code == 0
        assert "usage: overture" in capsys.readouterr().out
    for service in ("scheduler", "nodemgr", "engine", "kvstore"):
        assert main([service, "--help"]) == 0
        out = capsys.readouterr().out
        assert f"usage: overture {service}" in out and "[default:" in out


def test_demo_model_command(tmp_path: Path) -> None:
    from services.cli import main

    assert main(["demo-model", str(tmp_path / "m"), "--size", "tiny"]) == 0
    assert (tmp_path / "m" / "config.json").exists()
    assert (tmp_path / "m" / "tokenizer.json").exists()


def test_cluster_specs_wire_every_node_to_its_own_services() -> None:
    from services.local_cluster import cluster_specs

    specs, url = cluster_specs(
        nodes=2, http_port=18000, model_path="/models/x", dtype="float32", config="c.yaml"
    )
    assert url == "http://127.0.0.1:18000"
    assert [s.name for s in specs] == [
        "scheduler",
        "node0.kvstore",
        "node0.engine",
        "node0.nodemgr",
        "node1.kvstore",
        "node1.engine",
        "node1.nodemgr",
    ]

    def flag(argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]

    assert all(flag(s.argv, "--config") == "c.yaml" for s in specs)
    sched_grpc = flag(specs[0].argv, "--grpc-port")
    for i, base in ((0, 1), (1, 4)):
        kv, engine, nodemgr = (s.argv for s in specs[base : base + 3])
        assert flag(nodemgr, "--node-id") == flag(kv, "--node-id") == f"node{i}"
        assert flag(nodemgr, "--scheduler-address").endswith(f":{sched_grpc}")
        assert flag(nodemgr, "--engine-address").endswith(":" + flag(engine, "--port"))
        assert flag(nodemgr, "--kvstore-address").endswith(":" + flag(kv, "--port"))
        assert flag(engine, "--dtype") == "float32"
    ports = [flag(s.argv, "--port") for s in specs]
    assert len(set(ports)) == len(ports)
    # every service's /metrics on a port of its own, the nodemgr told where the others are
    metrics = [s.metrics for s in specs]
    assert all(metrics) and len(set(metrics)) == len(metrics)
    assert metrics[0] == "127.0.0.1:18000"  # the scheduler's on its HTTP port
    for base in (1, 4):
        kv, engine, nodemgr = specs[base : base + 3]
        assert kv.metrics.endswith(":" + flag(kv.argv, "--metrics-port"))
        assert flag(nodemgr.argv, "--metrics-targets") == (
            f"kvstore={kv.metrics},engine={engine.metrics}")


def test_the_discovery_file_lists_every_service(tmp_path: Path) -> None:
    from services.local_cluster import cluster_specs, write_file_sd

    specs, _ = cluster_specs(nodes=1, http_port=18000, model_path="m", dtype=None,
                             config=None)
    groups = json.loads(write_file_sd(specs, tmp_path / "t.json").read_text())
    assert [(g["labels"].get("node"), g["labels"]["service"]) for g in groups] == [
        (None, "scheduler"), ("node0", "kvstore"), ("node0", "engine"), ("node0", "nodemgr")]
    assert [g["targets"] for g in groups] == [[s.metrics] for s in specs]
    off, _ = cluster_specs(nodes=1, http_port=18000, model_path="m", dtype=None, config=None,
                           metrics=False)
    assert json.loads(write_file_sd(off, tmp_path / "t.json").read_text()) == []
