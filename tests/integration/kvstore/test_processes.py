"""Real kvstore processes over gRPC: peer streaming, kill -9 recovery, start-up errors."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest
import torch

from services.kvstore.wire import manifest_to_pb
from shared.chunk_codec import decode_chunk, encode_chunk
from shared.proto import kvstore_pb2 as pb
from tests.integration.kvstore.helpers import REPO, KVStoreProcess, channel, put_chunks, stub
from tests.s3_server import free_port
from tests.unit.kvstore.chunks import session_chunks, session_manifest


def s3_args(endpoint: str, bucket: str) -> list[str]:
    return [
        "--s3.endpoint-url",
        endpoint,
        "--s3.bucket",
        bucket,
        "--s3.credentials",  # (the harness's S3 server admits the pair of its cluster
        "cluster",  # secret, which the process has from the environment)
    ]


async def test_two_nodes_stream_a_session_layer_by_layer(tmp_path: Path) -> None:
    a = KVStoreProcess(["--node-id", "a", "--ssd-path", str(tmp_path / "a")], tmp_path / "a.log")
    b = KVStoreProcess(["--node-id", "b", "--ssd-path", str(tmp_path / "b")], tmp_path / "b.log")
    try:
        a.wait_ready()
        b.wait_ready()
        m = session_manifest("chat1", num_blocks=5, num_layers=4, bpc=2)
        chunks = session_chunks(m)
        async with channel(a.address) as ca, channel(b.address) as cb:
            sa, sb = stub(ca), stub(cb)
            reply = await put_chunks(sa, [encode_chunk(cm, t) for cm, t in chunks])
            assert (reply.stored, reply.rejected, reply.not_durable) == (12, 0, 0)
            assert (await sa.PutManifest(manifest_to_pb(m))).written
            # a corrupt blob is rejected, not stored
            bad = encode_chunk(*chunks[0])
            bad[-1] ^= 1
            assert (await put_chunks(sa, [bad])).rejected == 1

            pulled = await sb.PullSession(
                pb.PullSessionRequest(
                    session=pb.ManifestRef(tenant="t1", session_id="chat1"),
                    peer_address=a.address,
                    wait_durable=True,
                )
            )
            assert (pulled.found, pulled.chunks, pulled.missing) == (True, 12, 0)

            order = []
            req = pb.GetChunksRequest(
                session=pb.ManifestRef(tenant="t1", session_id="chat1"), window=2
            )
            async for msg in sb.GetChunks(req):
                assert msg.found
                c = decode_chunk(msg.blob)
                cm, t = chunks[len(order)]
                assert c.meta == cm and torch.equal(c.tensor, t)
                order.append((msg.layer, msg.index))
            assert order == [(layer, i) for layer in range(4) for i in range(3)]

            stat = await sb.Stat(pb.StatRequest(keys=[chunks[0][0].key, "t1/fp0/ff/0"]))
            assert list(stat.keys[0].tiers) == ["dram", "ssd"] and list(stat.keys[1].tiers) == []
            status = await sb.Status(pb.KVStoreStatusRequest())
            assert (
                status.healthy
                and status.node_id == "b"
                and [t.name for t in status.tiers] == ["dram", "ssd"]
            )

            with pytest.raises(grpc.aio.AioRpcError) as dead:
                await sb.PullSession(
                    pb.PullSessionRequest(
                        session=pb.ManifestRef(tenant="t1", session_id="chat1"),
                        peer_address=f"127.0.0.1:{free_port()}",
                    )
                )
            assert dead.value.code() == grpc.StatusCode.UNAVAILABLE

            evicted = await sb.Delete(
                pb.DeleteRequest(
                    session=pb.ManifestRef(tenant="t1", session_id="chat1"),
                    with_chunks=True,
                    tiers=["dram"],
                )
            )
            assert evicted.deleted == 12  # every chunk's DRAM copy; the manifest is not there
            stat = await sb.Stat(pb.StatRequest(keys=[chunks[0][0].key]))
            assert list(stat.keys[0].tiers) == ["ssd"]
            assert (await sb.GetManifest(pb.ManifestRef(tenant="t1", session_id="chat1"))).found
            async for msg in sb.GetChunks(req):  # still readable: from SSD, promoted again
                assert msg.found
            stat = await sb.Stat(pb.StatRequest(keys=[chunks[0][0].key]))
            assert list(stat.keys[0].tiers) == ["dram", "ssd"]
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await sb.Delete(pb.DeleteRequest(keys=[chunks[0][0].key], tiers=["tape"]))
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "tape" in (bad.value.details() or "")

            gone = await sb.Delete(
                pb.DeleteRequest(
                    session=pb.ManifestRef(tenant="t1", session_id="chat1"), with_chunks=True
                )
            )
            assert gone.deleted >= 12
            assert not (await sb.GetManifest(pb.ManifestRef(tenant="t1", session_id="chat1"))).found
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in sb.GetChunks(req):
                    pass
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        assert a.stop() == 0
        assert b.stop() == 0


async def test_kill9_during_writes_leaves_only_complete_manifests(
    tmp_path: Path, s3_endpoint: str
) -> None:
    bucket = f"crash-{uuid.uuid4().hex[:10]}"
    args = ["--ssd-path", str(tmp_path / "db"), *s3_args(s3_endpoint, bucket)]
    kv = KVStoreProcess(args, tmp_path / "kv1.log")
    kv.wait_ready()
    sessions = [session_manifest(f"s{i}", num_blocks=3, num_layers=3, bpc=2) for i in range(40)]

    written: list[str] = []

    async def writer(ms: list) -> None:
        async with channel(kv.address) as ch:
            st = stub(ch)
            for m in ms:
                await put_chunks(
                    st, [encode_chunk(cm, t) for cm, t in session_chunks(m)], wait_durable=False
                )
                if (await st.PutManifest(manifest_to_pb(m))).written:
                    written.append(m.session_id)

    tasks = [asyncio.create_task(writer(sessions[i::4])) for i in range(4)]
    # Kill in the middle of the burst, as soon as a few manifests exist.
    while len(written) < 4 and not any(t.done() for t in tasks):
        await asyncio.sleep(0.005)
    kv.kill9()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert any(isinstance(r, grpc.aio.AioRpcError) for r in results), (
        "the kill should cut the burst short"
    )

    kv2 = KVStoreProcess(args, tmp_path / "kv2.log")
    try:
        kv2.wait_ready()
        found = 0
        async with channel(kv2.address) as ch:
            st = stub(ch)
            for m in sessions:
                reply = await st.GetManifest(pb.ManifestRef(tenant="t1", session_id=m.session_id))
                if not reply.found:
                    continue
                found += 1
                expected = session_chunks(m)
                got = [
                    msg
                    async for msg in st.GetChunks(
                        pb.GetChunksRequest(
                            session=pb.ManifestRef(tenant="t1", session_id=m.session_id)
                        )
                    )
                ]
                assert len(got) == len(expected)
                for msg, (_cm, t) in zip(got, expected, strict=False):
                    assert msg.found, f"manifest {m.session_id} names missing chunk {msg.key}"
                    c = decode_chunk(msg.blob)  # checksum verified
                    assert torch.equal(c.tensor, t)
        assert 0 < found < len(sessions)
    finally:
        assert kv2.stop() == 0


def test_rocksdb_locked_is_a_clear_error_and_nonzero_exit(tmp_path: Path) -> None:
    first = KVStoreProcess(["--ssd-path", str(tmp_path / "db")], tmp_path / "first.log")
    try:
        first.wait_ready()
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.kvstore",
                "--port",
                "0",
                "--ssd-path",
                str(tmp_path / "db"),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 2
        assert "kvstore cannot start: kvstore.ssd_path" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        assert first.stop() == 0


def test_bad_config_names_the_key(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.kvstore", "--tiers", "dram,nvme"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "kvstore.tiers: unknown tier 'nvme'" in out.stderr
    assert "Traceback" not in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "services.kvstore", "--dram-bytes", "-5"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "kvstore.dram_bytes" in out.stderr


def test_metrics_endpoint_and_sigterm_clean_shutdown(tmp_path: Path) -> None:
    mport = free_port()
    kv = KVStoreProcess(
        ["--ssd-path", str(tmp_path / "db"), "--metrics-port", str(mport)], tmp_path / "kv.log"
    )
    kv.wait_ready()
    with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert "kvstore_write_behind_depth" in text
    kv.proc.send_signal(signal.SIGTERM)
    assert kv.proc.wait(20) == 0
    kv.log.close()
    assert "kvstore shutting down" in (tmp_path / "kv.log").read_text()
