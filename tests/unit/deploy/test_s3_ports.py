"""The S3 server's five ports: no role's port may be another role's gRPC port (+10000)."""
from __future__ import annotations

import pytest

from services import s3_server


def test_a_port_that_is_another_roles_grpc_sibling_is_skipped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The CI run that failed: master 33293 (gRPC 43293) and volume 43293.
    offered = iter([33293, 43293, 23293, 33293, 40001, 40002, 40003, 40004])
    monkeypatch.setattr(s3_server, "_ephemeral", lambda host: next(offered))
    monkeypatch.setattr(s3_server, "_free", lambda host, port: True)
    ports = s3_server.pick_ports()
    assert ports == [33293, 40001, 40002, 40003, 40004]
    every = ports + [p + s3_server.GRPC_OFFSET for p in ports]
    assert len(set(every)) == len(every)


def test_real_picks_never_collide() -> None:
    for _ in range(20):
        ports = s3_server.pick_ports()
        every = ports + [p + s3_server.GRPC_OFFSET for p in ports]
        assert len(set(every)) == len(every)
