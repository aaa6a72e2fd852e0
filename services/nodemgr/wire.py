"""Protobuf <-> dataclass conversion for the node manager."""

from __future__ import annotations

from dataclasses import dataclass

from shared.proto import common_pb2, engine_pb2, nodemgr_pb2, scheduler_pb2


@dataclass(frozen=True)
class ModelEntry:
    name: str
    fingerprint: str = ""
    max_model_len: int = 0
    dtype: str = ""
    num_layers: int = 0
    block_size: int = 0


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's answer to Status, as the node manager uses it."""

    models: tuple[ModelEntry, ...]
    running: int = 0
    waiting: int = 0
    blocks_free: int = 0
    blocks_total: int = 0


def snapshot(msg: engine_pb2.EngineStatus) -> EngineSnapshot:
    return EngineSnapshot(
        models=tuple(
            ModelEntry(m.name, m.fingerprint, m.max_model_len, m.dtype, m.num_layers, m.block_size)
            for m in msg.models
        ),
        running=msg.running,
        waiting=msg.waiting,
        blocks_free=msg.blocks_free,
        blocks_total=msg.blocks_total,
    )


def _model_info(m: ModelEntry) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        name=m.name,
        fingerprint=m.fingerprint,
        max_model_len=m.max_model_len,
        dtype=m.dtype,
        num_layers=m.num_layers,
        block_size=m.block_size,
    )


def register_request(
    node_id: str, address: str, models: tuple[ModelEntry, ...], kvstore_address: str
) -> scheduler_pb2.RegisterNodeRequest:
    return scheduler_pb2.RegisterNodeRequest(
        node_id=node_id,
        address=address,
        models=[_model_info(m) for m in models],
        kvstore_address=kvstore_address,
    )


def heartbeat(
    node_id: str, snap: EngineSnapshot | None, in_flight: int, problem: str
) -> scheduler_pb2.HeartbeatMsg:
    msg = scheduler_pb2.HeartbeatMsg(node_id=node_id, in_flight=in_flight, problem=problem)
    if snap is not None:
        msg.running = snap.running
        msg.waiting = snap.waiting
        msg.blocks_free = snap.blocks_free
        msg.blocks_total = snap.blocks_total
    return msg


def node_status(
    node_id: str, engine_status: engine_pb2.EngineStatus, kvstore_address: str
) -> nodemgr_pb2.NodeStatus:
    return nodemgr_pb2.NodeStatus(
        node_id=node_id,
        models=list(engine_status.models),
        running=engine_status.running,
        waiting=engine_status.waiting,
        engine=engine_status,
        kvstore_address=kvstore_address,
    )
