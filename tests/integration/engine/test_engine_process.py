"""``python -m services.engine`` as a real process, called over real gRPC on loopback."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.proto import common_pb2, engine_pb2, engine_pb2_grpc
from shared.shm_file import SHM_DIR
from tests.internal import sync_channel

REPO = Path(__file__).resolve().parents[3]
READY = re.compile(r"engine ready on ([\d.]+):(\d+)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.engine.model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("m") / "tiny", size="tiny", seed=0)


def wait_ready(proc: subprocess.Popen, log: Path, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        m = READY.search(text)
        if m:
            return f"{m.group(1)}:{m.group(2)}"
        if proc.poll() is not None:
            raise AssertionError(f"engine exited {proc.returncode}:\n{text}")
        time.sleep(0.1)
    raise AssertionError(f"engine not ready in {timeout_s}s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def engine(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, subprocess.Popen]]:
    log = tmp_path_factory.mktemp("logs") / "engine.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.engine",
                "--model-path",
                str(model_dir),
                "--port",
                "0",
                "--dtype",
                "float32",
                "--device-memory-bytes",
                "16MiB",
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield wait_ready(proc, log), proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the engine removes its shared memory), SIGKILL only if it hangs."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def request(**kw: object) -> common_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=8, ignore_eos=True)
    return common_pb2.GenerateRequest(sampling=sampling, **kw)


def test_generate_status_and_health(engine: tuple[str, subprocess.Popen]) -> None:
    address, _ = engine
    with sync_channel(address) as ch:
        stub = engine_pb2_grpc.EngineStub(ch)
        chunks = list(stub.Generate(request(request_id="r1", prompt="Hello there"), timeout=30))
        assert chunks[0].prompt_token_ids and chunks[0].prompt_tokens > 0
        assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 8
        assert sum(len(c.token_ids) for c in chunks) == 8
        again = list(
            stub.Generate(
                request(
                    input_kind=common_pb2.GenerateRequest.TOKEN_IDS,
                    prompt_token_ids=list(chunks[0].prompt_token_ids),
                ),
                timeout=30,
            )
        )
        assert [t for c in again for t in c.token_ids] == [t for c in chunks for t in c.token_ids]

        st = stub.Status(engine_pb2.EngineStatusRequest(), timeout=10)
        assert st.models[0].name == "tiny" and len(st.models[0].fingerprint) == 64
        assert st.models[0].num_layers == 2 and st.models[0].block_size == 16
        assert st.blocks_free + st.blocks_used + st.blocks_evictable == st.blocks_total
        assert st.blocks_used == 0 and st.running == 0 and st.device == "cpu"

        health = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="overture.v1.Engine"), timeout=10
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(
    "req, code",
    [
        (request(prompt=""), grpc.StatusCode.INVALID_ARGUMENT),
        (
            request(input_kind=common_pb2.GenerateRequest.TOKEN_IDS, prompt_token_ids=[5, 999999]),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (request(prompt="hi", model="other"), grpc.StatusCode.NOT_FOUND),
    ],
)
def test_bad_requests_get_status_codes(
    engine: tuple[str, subprocess.Popen], req: common_pb2.GenerateRequest, code: grpc.StatusCode
) -> None:
    address, _ = engine
    with sync_channel(address) as ch, pytest.raises(grpc.RpcError) as e:
        list(engine_pb2_grpc.EngineStub(ch).Generate(req, timeout=30))
    assert e.value.code() == code and e.value.details()


def test_cancelled_call_frees_blocks(engine: tuple[str, subprocess.Popen]) -> None:
    address, _ = engine
    with sync_channel(address) as ch:
        stub = engine_pb2_grpc.EngineStub(ch)
        long = common_pb2.GenerateRequest(
            prompt="Tell me everything",
            sampling=common_pb2.SamplingParams(max_tokens=2000, ignore_eos=True),
        )
        call = stub.Generate(long, timeout=60)
        next(call)
        call.cancel()
        deadline = time.monotonic() + 10
        while True:
            st = stub.Status(engine_pb2.EngineStatusRequest(), timeout=10)
            if st.running == 0 and st.blocks_used == 0:
                break
            assert time.monotonic() < deadline, f"blocks still held after cancel: {st}"
            time.sleep(0.05)


def test_sigterm_shuts_down_cleanly_and_frees_shared_memory(
    model_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "engine.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.engine",
                "--model-path",
                str(model_dir),
                "--port",
                "0",
                "--dtype",
                "float32",
                "--device-memory-bytes",
                "8MiB",
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_ready(proc, log)
        shm = list(SHM_DIR.glob(f"overture-kv-{proc.pid}-*"))
        assert len(shm) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
        assert not shm[0].exists()
    finally:
        stop(proc)


def test_missing_model_path_fails_with_the_fix(tmp_path: Path) -> None:
    env = dict(os.environ)
    env.pop("OVERTURE_ENGINE__MODEL_PATH", None)
    res = subprocess.run(
        [sys.executable, "-m", "services.engine", "--port", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert res.returncode != 0
    assert "overture demo-model" in res.stderr
