"""Leader election between scheduler replicas through a Kubernetes ``Lease``
(coordination.k8s.io/v1), spoken directly to the API server with the pod's service
account token.

Two replicas run; one holds the Lease and serves, the other stands by (its ``/leaderz``
answers 503, so the Service sends it no traffic and the nodes do not register with it).
Every ``renew_s`` each replica reads the Lease and:

    no Lease            create it naming itself (409: the other was faster)
    held by itself      renew it (renewTime = now)
    held by the other   take it only once the record has not changed for
                        ``duration_s`` as measured on *this* replica's clock (a holder
                        that stopped renewing); clocks of the two pods never compare
    released ("")       take it

Every write is a PUT carrying the ``resourceVersion`` read, so of two replicas racing for
one record the API server accepts one and answers 409 to the other. A leader that has not
renewed for ``duration_s`` (API server unreachable) stops serving before the other can
take over; on a clean stop it releases the Lease so the standby takes over at its next
poll instead of after ``duration_s``. The scheme is client-go's ``leaderelection``.

The state a new leader needs is persisted or rebuilt: stored responses in the shared S3,
session locations from the nodes' registrations (they reconnect to it within seconds).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

log = logging.getLogger(__name__)

Clock = Callable[[], float]


@dataclass(frozen=True)
class LeaseSettings:
    name: str  # the Lease object's name
    namespace: str
    identity: str  # this replica's name (the pod's)
    api_url: str  # https://kubernetes.default.svc
    token_file: str  # the service account token (re-read: it rotates)
    ca_file: str  # "" = the system's CAs
    duration_s: float = 10.0
    renew_s: float = 2.0


def _now_text() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElector:
    """Event-loop only; ``run()`` until cancelled. ``is_leader`` is what the replica
    serves by; ``changed`` is set on every change of it."""

    def __init__(self, settings: LeaseSettings, session: aiohttp.ClientSession,
                 clock: Clock = time.monotonic,
                 on_change: Callable[[bool], None] | None = None) -> None:
        self.s = settings
        self._http = session
        self._clock = clock
        self._on_change = on_change
        self.is_leader = False
        self._renewed_at = 0.0  # when this replica last wrote its own renewal
        self._observed: tuple[str, str] | None = None  # (holder, renewTime) last seen
        self._observed_at = 0.0  # when that record was first seen (this clock)

    @property
    def _path(self) -> str:
        return (f"{self.s.api_url}/apis/coordination.k8s.io/v1/namespaces/{self.s.namespace}"
                f"/leases/{self.s.name}")

    def _headers(self) -> dict[str, str]:
        token = Path(self.s.token_file).read_text().strip() if self.s.token_file else ""
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def run(self) -> None:
        try:
            while True:
                await self.step()
                await asyncio.sleep(self.s.renew_s)
        finally:
            if self.is_leader:
                await asyncio.shield(self.release())

    async def step(self) -> None:
        """One round: acquire or renew; step down when renewals have failed too long."""
        try:
            leader = await self._try_acquire_or_renew()
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            log.warning("lease %s/%s: %s", self.s.namespace, self.s.name, e)
            # Stop serving before the standby may take over (it waits duration_s from when
            # it saw our last renewal, which is later than when we wrote it).
            deadline = self.s.duration_s - self.s.renew_s
            leader = self.is_leader and (self._clock() - self._renewed_at < deadline)
        self._set(leader)

    async def release(self) -> None:
        """Give the Lease up (a clean stop): the standby need not wait for it to expire."""
        try:
            status, lease = await self._request("GET")
            if status == 200 and lease["spec"].get("holderIdentity") == self.s.identity:
                lease["spec"]["holderIdentity"] = ""
                await self._request("PUT", lease)
                log.info("released lease %s/%s", self.s.namespace, self.s.name)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            log.warning("could not release lease %s/%s: %s", self.s.namespace, self.s.name, e)
        self._set(False)

    def _set(self, leader: bool) -> None:
        if leader != self.is_leader:
            log.warning("this scheduler (%s) is %s", self.s.identity,
                        "now the leader: serving" if leader else "a standby: not serving")
            self.is_leader = leader
            if self._on_change is not None:
                self._on_change(leader)

    async def _request(self, method: str, body: dict[str, Any] | None = None
                       ) -> tuple[int, dict[str, Any]]:
        url = self._path if method != "POST" else self._path.rsplit("/", 1)[0]
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.s.renew_s))
        async with self._http.request(method, url, json=body, headers=self._headers(),
                                      timeout=timeout) as r:
            data = await r.json(content_type=None) if r.content_length != 0 else {}
            return r.status, data if isinstance(data, dict) else {}

    async def _try_acquire_or_renew(self) -> bool:
        status, lease = await self._request("GET")
        now = self._clock()
        if status == 404:
            created, _ = await self._request("POST", self._record({}, transitions=0))
            return self._wrote(created, now)
        if status != 200:
            raise ValueError(f"reading the lease: HTTP {status} {lease.get('message', '')}")
        spec = lease.get("spec", {})
        holder = spec.get("holderIdentity") or ""
        seen = (holder, spec.get("renewTime") or "")
        if seen != self._observed:
            self._observed, self._observed_at = seen, now
        expired = now - self._observed_at >= float(spec.get("leaseDurationSeconds")
                                                   or self.s.duration_s)
        if holder and holder != self.s.identity and not expired:
            return False
        transitions = int(spec.get("leaseTransitions") or 0) + (holder != self.s.identity)
        body = self._record(lease, transitions,
                            acquired=spec.get("acquireTime") if holder == self.s.identity
                            else None)
        written, _ = await self._request("PUT", body)
        return self._wrote(written, now)

    def _wrote(self, status: int, now: float) -> bool:
        if status in (200, 201):
            self._renewed_at = now
            return True
        if status == 409:  # the other replica wrote first: read again next round
            return False
        raise ValueError(f"writing the lease: HTTP {status}")

    def _record(self, lease: dict[str, Any], transitions: int,
                acquired: str | None = None) -> dict[str, Any]:
        now = _now_text()
        meta = {"name": self.s.name, "namespace": self.s.namespace}
        if "resourceVersion" in lease.get("metadata", {}):
            meta["resourceVersion"] = lease["metadata"]["resourceVersion"]
        return {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
            "spec": {"holderIdentity": self.s.identity,
                     "leaseDurationSeconds": max(1, round(self.s.duration_s)),
                     "acquireTime": acquired or now, "renewTime": now,
                     "leaseTransitions": transitions},
        }


def ssl_context(ca_file: str) -> ssl.SSLContext:
    """TLS to the API server, trusting the cluster's CA ("" = the system's)."""
    return ssl.create_default_context(cafile=ca_file or None)
