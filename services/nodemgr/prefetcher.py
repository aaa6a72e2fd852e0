"""The node's half of an advisory (Symphony §3.3): move the advised session's KV into place.

``Advise`` answers at once and prefetches in the background: the node's kvstore pulls the
session's newest KV into its DRAM, lowest layer first, from the kvstore that holds it (the
scheduler names it) or else from its own tiers and the shared S3 tier. A few prefetches
run at a time; ``Invalidate`` stops one still running (what already reached DRAM stays:
it is a cache, evicted like any other).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from services.nodemgr.channels import fast_channel
from shared.proto import kvstore_pb2, kvstore_pb2_grpc

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"  # (the engine stores a request without a tenant under this one)


@dataclass(frozen=True)
class Advice:
    advisory_id: str
    tenant: str
    session_id: str
    kv_source: str  # kvstore holding the session's KV; empty: this node's tiers and S3


class Prefetcher:
    def __init__(self, kvstore_address: str, timeout_s: float, concurrency: int = 4) -> None:
        self.channel = fast_channel(kvstore_address) if kvstore_address else None
        self.stub = kvstore_pb2_grpc.KVStoreStub(self.channel) if self.channel else None
        self.timeout_s = timeout_s
        self._gate = asyncio.Semaphore(concurrency)
        self._running: dict[str, asyncio.Task[None]] = {}

    def advise(self, advice: Advice) -> bool:
        """Start prefetching; False when this node has no kvstore to prefetch into."""
        if self.stub is None:
            return False
        old = self._running.pop(advice.advisory_id, None)
        if old is not None:
            old.cancel()
        task = asyncio.create_task(self._prefetch(advice), name=f"prefetch-{advice.session_id}")
        self._running[advice.advisory_id] = task
        task.add_done_callback(lambda t: self._done(advice.advisory_id, t))
        return True

    def invalidate(self, advisory_id: str) -> bool:
        """Stop the advisory's prefetch if it still runs; whether it did."""
        task = self._running.pop(advisory_id, None)
        if task is None or task.done():
            return False
        task.cancel()
        return True

    def _done(self, advisory_id: str, task: asyncio.Task[None]) -> None:
        if self._running.get(advisory_id) is task:
            del self._running[advisory_id]

    async def _prefetch(self, a: Advice) -> None:
        assert self.stub is not None
        request = kvstore_pb2.PrefetchSessionRequest(
            session=kvstore_pb2.ManifestRef(tenant=a.tenant or DEFAULT_TENANT,
                                            session_id=a.session_id),
            peer_address=a.kv_source,
        )
        async with self._gate:
            try:
                reply = await self.stub.PrefetchSession(request, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as e:
                log.warning("prefetch for advisory %s (session %s) failed: %s %s",
                            a.advisory_id, a.session_id, e.code().name, e.details())
                return
        if reply.found:
            log.info("advisory %s: session %s prefetched into DRAM (%d chunks, %d bytes%s)",
                     a.advisory_id, a.session_id, reply.chunks, reply.bytes,
                     f", {reply.missing} missing" if reply.missing else "")
        else:
            log.info("advisory %s: nothing stored for session %s (%s)", a.advisory_id,
                     a.session_id, reply.detail)

    async def close(self) -> None:
        tasks = list(self._running.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.channel is not None:
            await self.channel.close()
