"""Protobuf <-> dataclass conversion for the node manager."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.nodemgr.held_sessions import HeldSession
from shared.model_info import ModelInfo
from shared.proto import common_pb2, engine_pb2, nodemgr_pb2, scheduler_pb2


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's answer to Status, as the node manager uses it."""

    models: tuple[ModelInfo, ...]
    running: int = 0
    waiting: int = 0
    blocks_free: int = 0
    blocks_total: int = 0
    saved: tuple[common_pb2.SessionSaved, ...] = ()  # session saves, passed on as they are
    queue_delay_s: float = 0.0  # how long the oldest queued request has waited
    step_running_s: float = 0.0  # how long the forward step under way has run (0: idle)
    prefetch: common_pb2.PrefetchCounters | None = None  # passed on as it is
    parts: tuple[EngineSnapshot, ...] = ()  # one per engine of the node (engine_set.py)
    device_budget_bytes: int = 0

    @property
    def last_saved(self) -> int:
        """The number of the newest save reported (0: none)."""
        return max((s.seq for s in self.saved), default=0)


def snapshot(msg: engine_pb2.EngineStatus) -> EngineSnapshot:
    return EngineSnapshot(
        models=tuple(ModelInfo.from_proto(m) for m in msg.models),
        running=msg.running,
        waiting=msg.waiting,
        blocks_free=msg.blocks_free,
        blocks_total=msg.blocks_total,
        saved=tuple(msg.saved),
        queue_delay_s=msg.queue_delay_s,
        step_running_s=msg.step_running_s,
        prefetch=msg.prefetch if msg.HasField("prefetch") else None,
        device_budget_bytes=msg.device_budget_bytes,
    )


def register_request(
    node_id: str, address: str, models: tuple[ModelInfo, ...], kvstore_address: str,
    held: Sequence[HeldSession] = (),
    metrics: dict[str, str] | None = None,
) -> scheduler_pb2.RegisterNodeRequest:
    return scheduler_pb2.RegisterNodeRequest(
        node_id=node_id,
        address=address,
        models=[m.to_proto() for m in models],
        kvstore_address=kvstore_address,
        sessions=[scheduler_pb2.HeldSession(tenant=h.tenant, session_id=h.session_id,
                                            tokens=h.tokens, age_s=h.age_s) for h in held],
        metrics=metrics or {},
    )


def heartbeat(
    node_id: str, snap: EngineSnapshot | None, in_flight: int, problem: str, degraded: str = ""
) -> scheduler_pb2.HeartbeatMsg:
    msg = scheduler_pb2.HeartbeatMsg(
        node_id=node_id, in_flight=in_flight, problem=problem, degraded=degraded
    )
    if snap is not None:
        msg.queue_delay_s = snap.queue_delay_s
        msg.running = snap.running
        msg.waiting = snap.waiting
        msg.blocks_free = snap.blocks_free
        msg.blocks_total = snap.blocks_total
        msg.saved.extend(snap.saved)
        msg.device_budget_bytes = snap.device_budget_bytes
        if snap.prefetch is not None:
            msg.prefetch.CopyFrom(snap.prefetch)
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


def status_request(saved_after: int = 0) -> engine_pb2.EngineStatusRequest:
    return engine_pb2.EngineStatusRequest(saved_after=saved_after)


def request_id_of(msg: common_pb2.GenerateRequest) -> str:
    return msg.request_id


def heartbeat_interval(reply: scheduler_pb2.RegisterNodeReply) -> float:
    """The interval the scheduler asks for (0: keep ours)."""
    return reply.heartbeat_interval_s
