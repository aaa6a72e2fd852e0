"""A node's death loses no conversation (``overture up`` supervising real processes on
loopback, with its SeaweedFS S3 server): kill -9 of a node's engine, kvstore or nodemgr
while streams run leaves the cluster serving, the dead part is restarted, and the
session continues on the other node with exactly the recomputed tokens: from S3 when the
node's kvstore died, by recompute when there is no S3. The first turn after a kvstore
restart keeps its KV (the engine re-attaches its pool and saves again)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import pytest
import torch

from services.engine.api_types import ChatMessage
from services.engine.model import LoadedModel, load_model
from services.local_cluster import free_port
from tests.cluster import REPO, Cluster
from tests.integration.reuse.harness import USER_TURNS, reference_transcript
from tests.s3_server import aws_keys

CONFIG = """
scheduler:
  heartbeat_interval_s: 0.2
  heartbeat_timeout_s: 1.5
  no_node_wait_s: 2.0
  stream_idle_timeout_s: 3.0
nodemgr:
  heartbeat_interval_s: 0.2
  engine_status_timeout_s: 1.0
engine:
  offload:
    policy: always
    save_timeout_s: 150  # (a restarted kvstore maps the pool at its first AttachPool: slow)
kvstore:
  chunk_tokens: 64
  tiers: [dram, s3]
"""
STARTED = re.compile(r"^started (\S+) \(pid (\d+)\)$")


@dataclass
class Up:
    """An ``overture up`` process: its merged output, and the pid of each child."""

    proc: subprocess.Popen
    api: Cluster
    lines: list[str] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)
    _queue: queue.Queue = field(default_factory=queue.Queue)

    log: Path | None = None  # every line is kept here too (for a post-mortem)

    def pump(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log or os.devnull, "a") as keep:
            for line in iter(self.proc.stdout.readline, ""):
                keep.write(line)
                keep.flush()
                self._queue.put(line.rstrip("\n"))

    def read(self) -> None:
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                return
            self.lines.append(line)
            if m := STARTED.match(line):
                self.pids[m.group(1)] = int(m.group(2))

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match:
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            self.read()
            for line in self.lines[seen:]:
                if m := re.search(pattern, line):
                    return m
            seen = len(self.lines)
            assert self.proc.poll() is None, "overture up exited:\n" + self.tail()
            assert time.monotonic() < deadline, f"no {pattern!r} in:\n" + self.tail()
            time.sleep(0.05)

    def tail(self, n: int = 80) -> str:
        self.read()
        return "\n".join(self.lines[-n:])

    def s3_endpoint(self) -> str:
        cmdline = Path(f"/proc/{self.pids['s3']}/cmdline").read_bytes().split(b"\0")
        port = next(a.split(b"=")[1] for a in cmdline if a.startswith(b"-s3.port="))
        return f"http://127.0.0.1:{port.decode()}"


@contextlib.contextmanager
def overture_up(model: Path, work: Path, *extra: str) -> Iterator[Up]:
    port = free_port()
    (work / "overture.yaml").write_text(CONFIG)
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--nodes", "2", "--port", str(port),
         "--model", str(model), "--config", "overture.yaml", *extra],
        cwd=work, env=dict(os.environ, PYTHONPATH=str(REPO)), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    up = Up(proc, Cluster(url=f"http://127.0.0.1:{port}", log_dir=work))
    up.log = work / "overture-up.log"
    threading.Thread(target=up.pump, daemon=True).start()
    try:
        up.wait_for("Overture is ready at", timeout=300)
        # Engines serve before their pools are attached: wait for both attachments.
        deadline = time.monotonic() + 120
        while sum("KV pool attached" in line for line in up.lines) < 2:
            assert time.monotonic() < deadline, up.tail()
            time.sleep(0.1)
            up.read()
        yield up
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


Transcript = list[tuple[list[ChatMessage], list[int], str]]


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> dict[str, Transcript]:
    """Two turns per case from a recompute-only engine; each case's conversation is its
    own (KV is found by content: a shared one would be on every node's device already)."""
    loaded: LoadedModel = load_model(tiny_model, dtype=torch.float32)

    async def all_cases() -> dict[str, Transcript]:
        return {case: await reference_transcript(
                    loaded, [f"({case}) {USER_TURNS[0]}", USER_TURNS[1]])
                for case in ("engine", "kvstore", "nodemgr", "no-s3", "first-save")}

    return asyncio.run(all_cases())


def _body(messages: list[ChatMessage], **extra: object) -> dict:
    return {"messages": [{"role": m.role, "content": m.content} for m in messages],
            "max_tokens": 10, "ignore_eos": True, "temperature": 0, "return_token_ids": True,
            **extra}


def _serve_only(up: Up, node: str) -> None:
    for n in ("node0", "node1"):
        status, answer = up.api.post(f"/admin/nodes/{n}/{'undrain' if n == node else 'drain'}",
                                     {})
        assert status == 200, answer
    deadline = time.monotonic() + 30
    while up.api.get("/readyz")[1].get("healthy_nodes") != [node]:
        assert time.monotonic() < deadline, up.tail()
        time.sleep(0.05)


def _kv_from_counts(up: Up) -> dict[str, float]:
    out = {}
    for line in up.api.text("/metrics").splitlines():
        if m := re.match(r'overture_turns_total\{kv_from="(\w+)"\} (\S+)', line):
            out[m.group(1)] = float(m.group(2))
    return out


def _s3_keys(endpoint: str) -> int:
    client = boto3.client("s3", endpoint_url=endpoint, **aws_keys(), region_name="us-east-1")
    return client.list_objects_v2(Bucket="overture-kv").get("KeyCount", 0)


def _wait_s3_settled(endpoint: str, above: int, timeout: float = 30.0) -> None:
    """Until the bucket holds more than ``above`` objects and stops growing for 1 s."""
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while True:
        count = _s3_keys(endpoint)
        if count != last:
            last, since = count, time.monotonic()
        elif count > above and time.monotonic() - since > 1.0:
            return
        assert time.monotonic() < deadline, f"S3 never settled above {above} ({count})"
        time.sleep(0.1)


def _background_streams(up: Up, count: int) -> tuple[list[threading.Thread], list]:
    """``count`` streaming requests running meanwhile; each records how it ended."""
    ended: list = []

    def run(i: int) -> None:
        body = json.dumps({"messages": [{"role": "user", "content": f"background {i}"}],
                           "max_tokens": 1500, "ignore_eos": True, "stream": True}).encode()
        req = urllib.request.Request(up.api.url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                events = [line.decode().strip() for line in r if line.startswith(b"data: ")]
            error = [e for e in events if '"error"' in e]
            ended.append(("error", json.loads(error[0][6:])) if error else ("done", events[-1]))
        except urllib.error.HTTPError as e:
            ended.append(("http", e.code, json.loads(e.read())))
        except Exception as e:  # (a cut connection: recorded, and fails the check below)
            ended.append(("broken", repr(e)))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    return threads, ended


def _kill_and_continue(up: Up, part: str, reference: Transcript, s3: bool) -> str:
    """Session turn 1 on node0, kill -9 node0's ``part`` with streams running, turn 2 on
    node1; returns where turn 2's KV came from. Waits until ``part`` is back."""
    (m1, want1, _), (m2, want2, _) = reference
    session = f"fault-{part}-{'s3' if s3 else 'nos3'}"
    _serve_only(up, "node0")
    before_keys = _s3_keys(up.s3_endpoint()) if s3 else 0
    status, answer, headers = up.api.post_with_headers(
        "/v1/chat/completions", _body(m1), headers={"X-Session-Id": session})
    assert status == 200 and headers["X-Overture-Node"] == "node0", answer
    assert answer["choices"][0]["token_ids"] == want1
    if s3:
        _wait_s3_settled(up.s3_endpoint(), before_keys)
    threads, ended = _background_streams(up, 3)
    time.sleep(0.3)  # streaming on node0
    name = f"node0.{part}"
    old_pid = up.pids[name]
    os.kill(old_pid, signal.SIGKILL)
    _serve_only(up, "node1")
    before = _kv_from_counts(up)
    status, answer, headers = up.api.post_with_headers(
        "/v1/chat/completions", _body(m2), headers={"X-Session-Id": session})
    assert status == 200 and headers["X-Overture-Node"] == "node1", (answer, up.tail())
    assert answer["choices"][0]["token_ids"] == want2, up.tail()
    after = _kv_from_counts(up)
    kv_from = next(k for k in after if after[k] > before.get(k, 0.0))
    # The streams that were running ended, cleanly, whatever happened to their node.
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "a stream hung after " + name + " died\n" + up.tail()
    assert len(ended) == len(threads), ended
    for outcome in ended:
        assert outcome[0] in ("done", "error", "http"), outcome
        if outcome[0] == "http":
            assert outcome[1] >= 500 and "error" in outcome[2], outcome
    # The supervisor said what happened and restarted it; the node comes back.
    up.wait_for(rf"{re.escape(name)} \(pid {old_pid}\) was killed by SIGKILL")
    deadline = time.monotonic() + 60
    while up.pids[name] == old_pid:
        assert time.monotonic() < deadline, up.tail()
        time.sleep(0.1)
        up.read()
    assert up.api.post("/admin/nodes/node0/undrain", {})[0] == 200
    deadline = time.monotonic() + 60
    while True:
        nodes = up.api.get("/readyz")[1]["nodes"]
        if all(nodes[n]["state"] == "serving" for n in ("node0", "node1")):
            break
        assert time.monotonic() < deadline, (nodes, up.tail())
        time.sleep(0.1)
    return kv_from


@pytest.fixture(scope="module")
def up(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    with overture_up(tiny_model, tmp_path_factory.mktemp("up")) as u:
        yield u


@pytest.mark.slow
@pytest.mark.parametrize("part", ["engine", "kvstore", "nodemgr"])
def test_a_killed_part_restarts_and_its_session_continues(
    up: Up, part: str, reference: dict[str, Transcript]
) -> None:
    kv_from = _kill_and_continue(up, part, reference[part], s3=True)
    if part == "kvstore":
        # node0's memory died with it and it keeps no SSD here: only S3 still has the turn.
        assert kv_from == "s3", up.tail()
    else:
        # node0's kvstore lives: the turn comes from it, or from S3 when the holder was
        # unreachable at that moment (a node without its nodemgr leaves the rotation).
        assert kv_from in ("peer", "s3"), (kv_from, up.tail())


@pytest.mark.slow
def test_without_s3_a_dead_kvstore_means_recompute_still_correct(
    tiny_model: Path, tmp_path: Path, reference: dict[str, Transcript]
) -> None:
    with overture_up(tiny_model, tmp_path, "--no-s3") as u:
        assert _kill_and_continue(u, "kvstore", reference["no-s3"], s3=False) == "recompute"


def _wait_restarted(up: Up, name: str, old_pid: int) -> None:
    up.wait_for(rf"{re.escape(name)} \(pid {old_pid}\) was killed by SIGKILL")
    deadline = time.monotonic() + 60
    while up.pids[name] == old_pid:
        assert time.monotonic() < deadline, up.tail()
        time.sleep(0.1)
        up.read()
    while up.api.get("/readyz")[1]["nodes"]["node0"]["state"] != "serving":
        assert time.monotonic() < deadline, up.tail()
        time.sleep(0.1)


def _manifests(endpoint: str, session: str) -> list[str]:
    client = boto3.client("s3", endpoint_url=endpoint, **aws_keys(), region_name="us-east-1")
    listed = client.list_objects_v2(Bucket="overture-kv", Prefix="overture/m/default/")
    return [o["Key"] for o in listed.get("Contents", []) if f"/{session}@" in o["Key"]]


@pytest.mark.slow
def test_the_first_save_after_a_kvstore_restart_is_kept(
    up: Up, reference: dict[str, Transcript]
) -> None:
    """The engine still holds the pool id the dead kvstore gave it; the restarted one has
    never heard of it. The turn's save is refused once, the engine re-attaches and saves
    again: its manifest reaches S3 and the next turn, on the other node, reuses it."""
    (m1, want1, _), (m2, want2, _) = reference["first-save"]
    session = "first-save-after-kvstore-restart"
    _serve_only(up, "node0")
    name = "node0.kvstore"
    old_pid = up.pids[name]
    os.kill(old_pid, signal.SIGKILL)
    _wait_restarted(up, name, old_pid)
    status, answer, headers = up.api.post_with_headers(
        "/v1/chat/completions", _body(m1), headers={"X-Session-Id": session})
    assert status == 200 and headers["X-Overture-Node"] == "node0", answer
    assert answer["choices"][0]["token_ids"] == want1
    deadline = time.monotonic() + 180  # (a bound, not a timing claim: the save waits
    while not _manifests(up.s3_endpoint(), session):  # for the re-attachment) its KV, durable
        assert time.monotonic() < deadline, "the first save was lost\n" + up.tail()
        time.sleep(0.1)
    _serve_only(up, "node1")
    before = _kv_from_counts(up)
    status, answer, headers = up.api.post_with_headers(
        "/v1/chat/completions", _body(m2), headers={"X-Session-Id": session})
    assert status == 200 and headers["X-Overture-Node"] == "node1", answer
    assert answer["choices"][0]["token_ids"] == want2
    after = _kv_from_counts(up)
    assert any(after.get(k, 0.0) > before.get(k, 0.0) for k in ("s3", "peer")), (before, after)
    assert up.api.post("/admin/nodes/node0/undrain", {})[0] == 200
