"""Start kvstore processes and talk to them over real gRPC."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc

from shared.grpc_server import insecure_channel
from shared.proto import kvstore_pb2 as pb
from shared.proto import kvstore_pb2_grpc as pb_grpc
from tests.s3_server import free_port

REPO = Path(__file__).resolve().parents[3]


class KVStoreProcess:
    """``python -m services.kvstore`` as a child process, ready when its port answers."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(
            os.environ, AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", PYTHONPATH=str(REPO)
        )
        self.log = open(log_path, "ab")  # noqa: SIM115  (kept open for the process; closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.kvstore", "--port", str(self.port), *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
        )

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"kvstore exited {self.proc.returncode}: {self.log_path.read_text()[-2000:]}"
                )
            if "kvstore ready on" in self.log_path.read_text():
                return
            time.sleep(0.05)
        raise RuntimeError("kvstore did not become ready")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()


def stub(channel: grpc.aio.Channel) -> pb_grpc.KVStoreStub:
    return pb_grpc.KVStoreStub(channel)


def channel(address: str) -> grpc.aio.Channel:
    return insecure_channel(address)


async def put_chunks(
    st: pb_grpc.KVStoreStub, blobs: list[bytes], wait_durable: bool = True
) -> pb.PutChunksReply:
    async def gen():
        for b in blobs:
            yield pb.ChunkData(blob=bytes(b), wait_durable=wait_durable)

    return await st.PutChunks(gen())
