"""The Scheduler gRPC service: node registration and the heartbeat stream."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from services.scheduler import wire
from services.scheduler.cluster import NodeRegistry, PrefixIndex, SessionDirectory
from shared.proto import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(
        self,
        registry: NodeRegistry,
        heartbeat_interval_s: float,
        sessions: SessionDirectory | None = None,
        leader: Callable[[], bool] = lambda: True,
        prefixes: PrefixIndex | None = None,
    ) -> None:
        self.registry = registry
        self.interval = heartbeat_interval_s
        self.sessions = sessions
        self.leader = leader
        self.prefixes = prefixes  # fed by the save reports too
        self._closing = asyncio.Event()

    async def close(self) -> None:
        """End the open heartbeat streams, so that the server stops without waiting on them."""
        self._closing.set()

    def leadership_changed(self, leader: bool) -> None:
        """A replica that lost the Lease ends its nodes' streams (they register again, with
        the new leader); one that won it takes streams again."""
        if leader:
            self._closing = asyncio.Event()
        else:
            self._closing.set()

    async def RegisterNode(
        self, request: scheduler_pb2.RegisterNodeRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.RegisterNodeReply:
        info = wire.node_info(request)
        if not self.leader():
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "this scheduler replica is a standby; register with the leader")
        if not info.node_id or not info.address:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "node_id and address are required"
            )
        self.registry.register(info)
        restored = 0
        if self.sessions is not None:
            for h in request.sessions:
                restored += self.sessions.restore(h.tenant, h.session_id, info.node_id,
                                                  h.tokens, h.age_s)
                if self.prefixes is not None:  # (forgotten at the registration: re-seeded)
                    self.prefixes.saved(h.tenant, h.session_id, info.node_id)
        log.info(
            "node %s registered at %s serving %s (KV of %d sessions here, %d news to us)",
            info.node_id,
            info.address,
            ", ".join(m.name for m in info.models) or "no models",
            len(request.sessions),
            restored,
        )
        return wire.register_reply(self.interval)

    async def _next_beat(
        self, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.HeartbeatMsg | None:
        """The next beat, or None when the node closed the stream or we are shutting down."""
        read = asyncio.ensure_future(context.read())
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait({read, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
            if not read.done():
                read.cancel()
        if not read.done() or read.cancelled():
            return None
        beat = read.result()
        return None if beat is grpc.aio.EOF else beat

    async def Heartbeat(
        self,
        request_iterator: AsyncIterator[scheduler_pb2.HeartbeatMsg],
        context: grpc.aio.ServicerContext,
    ) -> None:
        node_id = ""
        generation: int | None = None
        try:
            while (beat := await self._next_beat(context)) is not None:
                node_id, load = wire.beat(beat)
                known = self.registry.heartbeat(node_id, load)
                if known and self.sessions is not None:
                    for s in wire.saved_sessions(beat):
                        self.sessions.saved(s.tenant, s.session_id, node_id, s.tokens)
                        if self.prefixes is not None:
                            self.prefixes.saved(s.tenant, s.session_id, node_id)
                node = self.registry.get(node_id)
                if node is not None and generation is None:
                    generation = node.generation
                in_rotation = node is not None and self.registry.in_rotation(node)
                await context.write(wire.heartbeat_ack(known, in_rotation))
        finally:
            # The stream ends when the node manager stops or loses us: take it out of
            # rotation now instead of waiting for the timeout; it re-registers to return.
            # A stream ended by the node's own re-registration leaves the new one alone.
            if generation is not None:
                log.info("heartbeat stream of node %s ended", node_id)
                self.registry.suspend(node_id, self.interval, generation)
