"""The simulated cluster: the scheduler's real code on a simulated clock, and N engines.

``simulate`` replays a ``Trace`` as ``bench.workloads.replay.Replayer`` does against a
real cluster (each turn advised when typing starts and sent when it ends, both shifted by
how long the previous answers took) and returns the same ``Result`` per request.

Reused from the services, not re-implemented: the placement policy (``POLICIES``), the
``NodeRegistry`` (fed heartbeats of each node's running and waiting counts every
``heartbeat_s``, plus its own routed counts), the ``SessionDirectory`` (where each
session's last turn ran), the ``AdvisoryPlacement`` (the ``Advisor``'s choice of node and
its book of pending advisories, each counted on its node until followed or expired,
without the Advisor's gRPC calls), and per node the engine's ``BlockAllocator``
(``memory.py``).

Where KV lives: a node's device memory (its allocator's prefix cache), its kvstore's DRAM
(each finished turn is saved there; least recently saved sessions spill to S3), and S3.
A request reuses what its node's device holds, then loads the rest from the node's DRAM,
from the holder's node over the peer link (policies that move KV), or from S3, whichever
holds it, when the load is cheaper than recomputing; ``recompute`` reuses nothing;
``prefix`` reuses only what the device holds and saves nothing to a tier.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from bench.sim.costs import DEVICE, DRAM, PEER, S3, Calibration
from bench.sim.memory import NodeMemory, Prefetch
from bench.sim.node import Req, SimNode
from bench.workloads.replay import Result
from bench.workloads.trace import Session, Trace
from services.scheduler.advisory import AdvisoryBook, AdvisoryPlacement
from services.scheduler.cluster import Load, ModelSpec, NodeInfo, NodeRegistry, SessionDirectory
from services.scheduler.routing import RoutePlan, RouteRequest, make_policy
from services.scheduler.routing.policy import MOVE_TOKENS

MODEL = "sim"
TENANT = "default"
ADVISORY_TTL_S = 30.0  # scheduler.advisory_ttl_s's default
LOAD_PERIOD_S = 0.25  # as bench/eval/measure.py samples /readyz


@dataclass
class SimOutcome:
    results: list[Result]
    load: list[tuple[float, dict[str, int]]]  # (seconds, node -> running + waiting)
    bytes_by_tier: dict[str, int] = field(default_factory=dict)  # KV loaded, by tier
    purged_blocks: int = 0


class Simulator:
    def __init__(self, trace: Trace, *, policy: str, nodes: int, calibration: Calibration,
                 time_scale: float = 1.0, max_answer_tokens: int = 1024,
                 cooperative: bool = True, purge_order: str = "layers",
                 layerwise: bool = True, move_tokens: int = MOVE_TOKENS) -> None:
        self.trace, self.cal = trace, calibration
        self.time_scale, self.max_answer = time_scale, max_answer_tokens
        self.layerwise = layerwise
        self.policy = make_policy(policy, move_tokens)
        self._plans: dict[str, RoutePlan] = {}  # the plan of each session's turn in flight
        self.now = 0.0
        clock = lambda: self.now  # noqa: E731
        self.registry = NodeRegistry(3 * calibration.heartbeat_s, clock=clock)
        self.sessions = SessionDirectory(1 << 30, 24 * 3600.0, clock=clock)
        self.book = AdvisoryBook(ADVISORY_TTL_S, 1 << 30, clock=clock, per_tenant=1 << 30)
        self.advisories = AdvisoryPlacement(self.book, self.registry, self.policy,
                                            self.sessions)
        self.nodes: dict[str, SimNode] = {}
        self.memory: dict[str, NodeMemory] = {}
        self.dram: dict[str, OrderedDict[str, int]] = {}  # node -> session -> tokens
        self.s3: dict[str, int] = {}
        for i in range(nodes):
            nid = f"node{i:02d}"
            self.registry.register(NodeInfo(nid, nid, (ModelSpec(MODEL),)))
            self.nodes[nid] = SimNode(nid, calibration, self._admit, self._finished,
                                      self._step_at)
            self.memory[nid] = NodeMemory(calibration.device_blocks, calibration.layer_groups,
                                          cooperative, purge_order)
            self.dram[nid] = OrderedDict()
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self.results: list[Result] = []
        self.load: list[tuple[float, dict[str, int]]] = []
        self.bytes_by_tier = {DEVICE: 0, DRAM: 0, PEER: 0, S3: 0}
        self._shift: dict[str, float] = {}  # session -> seconds its turns moved by
        self._open = len(trace.sessions)
        self._index = {s.session_id: s for s in trace.sessions}

    # -- the event loop ---------------------------------------------------------------------

    def _at(self, t: float, kind: str, payload: object = None) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def _step_at(self, t: float, node: SimNode, version: int) -> None:
        self._at(t, "step", (node, version))

    def run(self) -> SimOutcome:
        ts = self.time_scale
        for s in self.trace.sessions:
            self._shift[s.session_id] = 0.0
            self._turn_events(s, 0)
            for at in s.spurious_at:
                self._at(at * ts, "advise", (s, -1))
        self._at(0.0, "beat")
        self._at(0.0, "sample")
        while self._events:
            t, _, kind, payload = heapq.heappop(self._events)
            self.now = t
            if kind == "step":
                node, version = payload  # type: ignore[misc]
                node.step_ended(t, version)
            elif kind == "deliver":
                node, req = payload  # type: ignore[misc]
                node.submit(req, t)
            elif kind == "request":
                self._request(*payload)  # type: ignore[misc]
            elif kind == "advise":
                self._advise(payload[0])  # type: ignore[index]
            elif kind == "beat":
                self._beat()
            elif kind == "sample":
                self.load.append((t, {n: node.load for n, node in self.nodes.items()}))
                if self._open:
                    self._at(t + LOAD_PERIOD_S, "sample")
        purged = sum(m.purged_blocks for m in self.memory.values())
        results = sorted(self.results, key=lambda r: (r.sent_at, r.session_id))
        return SimOutcome(results, self.load, dict(self.bytes_by_tier), purged)

    def _turn_events(self, s: Session, i: int) -> None:
        turn, shift = s.turns[i], self._shift[s.session_id]
        if turn.advisory_at is not None:
            self._at(turn.advisory_at * self.time_scale + shift, "advise", (s, i))
        self._at(turn.request_at * self.time_scale + shift, "request", (s, i))

    def _beat(self) -> None:
        for nid, node in self.nodes.items():
            alloc = self.memory[nid].alloc
            self.registry.heartbeat(nid, Load(running=len(node.running),
                                              waiting=len(node.waiting),
                                              blocks_free=alloc.num_free,
                                              blocks_total=alloc.num_total))
        for adv in self.advisories.sweep():  # lapsed advisories: their prefetch goes first
            self._end_prefetch(adv.node_id, adv.session_id, expired=True)
        if self._open:
            self._at(self.now + self.cal.heartbeat_s, "beat")

    # -- the scheduler side -----------------------------------------------------------------

    def _choose(self, session_id: str, priority: int, advised: str = "") -> RoutePlan:
        place = self.sessions.where(TENANT, session_id)
        route = RouteRequest(MODEL, session_id, TENANT, priority,
                             holder=place.node_id if place else "", advised=advised,
                             holder_tokens=place.turn_tokens if place else 0,
                             prefix_hits=self._prefix_hits(session_id, place.turn_tokens
                                                           if place else 0))
        healthy = [n for n in self.registry.healthy(MODEL) if not self.registry.behind(n)]
        plan = self.policy.route(healthy or self.registry.healthy(MODEL), route)
        assert plan is not None, "no healthy node"
        return plan

    def _prefix_hits(self, session_id: str, tokens: int) -> tuple[tuple[str, int], ...]:
        """(node, leading history blocks whole on its device) for the ``prefix`` policy:
        the simulator knows each device exactly, as llm-d's router learns it from KV
        events. Empty for the other policies (they do not read it)."""
        if self.policy.name != "prefix" or tokens < self.cal.block_tokens:
            return ()
        n, groups = tokens // self.cal.block_tokens, self.cal.layer_groups
        out = []
        for nid, mem in self.memory.items():
            held = mem.resident(session_id, n)
            k = next((i for i, g in enumerate(held) if g < groups), len(held))
            if k:
                out.append((nid, k))
        return tuple(out)

    def _advise(self, s: Session) -> None:
        placed = self.advisories.place(TENANT, s.session_id, MODEL, s.priority)
        assert placed is not None, "no healthy node"
        for old, _how in placed.ended:
            self._end_prefetch(old.node_id, old.session_id, expired=False)
        if not placed.plan.prefetch or placed.place is None:
            return
        self._prefetch(placed.node.node_id, s.session_id, placed.place.turn_tokens,
                       placed.plan.pull_from)

    def _prefetch(self, nid: str, session_id: str, tokens: int, pull_from: str) -> None:
        """Start moving the session's KV into the node's device memory."""
        bt, groups = self.cal.block_tokens, self.cal.layer_groups
        nblocks = tokens // bt
        mem = self.memory[nid]
        if nblocks == 0 or mem.resident(session_id, nblocks) == [groups] * nblocks:
            return
        tier = self._source(nid, session_id, nblocks * bt, pull_from)
        if tier is None:
            return
        node = self.nodes[nid]
        head = node.waiting[0] if node.waiting else None
        reserve = groups * -(-(head.prompt + head.out) // bt) if head else 0
        start = max(self.now, node.link_free_at)
        full_s = self.cal.load_s(tier, nblocks * bt * self.cal.kv_bytes_per_token)
        p = Prefetch(session_id, self.now, start=start, per_group_s=full_s / groups, tier=tier)
        got = mem.prefetch(p, nblocks, reserve)
        if got:
            node.link_free_at = start + got * p.per_group_s
            self.bytes_by_tier[tier] += nblocks * bt * self.cal.kv_bytes_per_token * got // groups

    def _end_prefetch(self, nid: str, session_id: str, expired: bool) -> None:
        self.memory[nid].drop_prefetch(session_id, expired)
        self.nodes[nid].wake(self.now)

    def _request(self, s: Session, i: int) -> None:
        adv, how = self.advisories.follow(TENANT, s.session_id)
        advised = adv.node_id if adv is not None and how == "followed" else ""
        if adv is not None and adv.node_id != advised:  # lapsed: its prefetch is of no use
            self._end_prefetch(adv.node_id, s.session_id, expired=True)
        plan = self._choose(s.session_id, s.priority, advised)
        nid = plan.node.node_id
        self._plans[s.session_id] = plan
        self.registry.begin(nid)
        turn = s.turns[i]
        context = sum(t.user_tokens + min(t.answer_tokens, self.max_answer)
                      for t in s.turns[:i])
        req = Req(s.session_id, i, turn.advisory_at is not None, s.priority, self.now,
                  context, turn.user_tokens, max(1, min(turn.answer_tokens, self.max_answer)))
        if adv is not None and adv.node_id != nid:
            self._end_prefetch(adv.node_id, s.session_id, expired=False)
        # (routing and the call to the engine take request_overhead_s)
        self._at(self.now + self.cal.request_overhead_s, "deliver", (self.nodes[nid], req))

    # -- where KV is ------------------------------------------------------------------------

    def _source(self, nid: str, session_id: str, tokens: int, pull_from: str) -> str | None:
        """The tier ``nid`` would load ``tokens`` of the session's history from
        (``pull_from``: the node its plan pulls the KV from, "": none)."""
        if self.dram[nid].get(session_id, 0) >= tokens:
            return DRAM
        if pull_from and self.dram[pull_from].get(session_id, 0) >= tokens:
            return PEER
        if self.s3.get(session_id, 0) >= tokens:
            return S3
        return None

    def _save(self, nid: str, session_id: str, tokens: int) -> None:
        """The node's kvstore keeps the finished turn in DRAM; the oldest spill to S3."""
        dram = self.dram[nid]
        dram.pop(session_id, None)
        dram[session_id] = tokens
        cap = self.cal.dram_bytes // self.cal.kv_bytes_per_token
        while sum(dram.values()) > cap and len(dram) > 1:
            old, n = dram.popitem(last=False)
            self.s3[old] = max(self.s3.get(old, 0), n)

    # -- the engine side --------------------------------------------------------------------

    def _admit(self, node: SimNode, req: Req, now: float) -> bool:
        """Plan the request's KV (device, a tier, or recompute) and take its blocks."""
        cal, mem = self.cal, self.memory[node.node_id]
        bt, groups = cal.block_tokens, cal.layer_groups
        mem.settle(req.session_id, now)
        total_blocks = -(-(req.prompt + req.out) // bt)
        hist_blocks = min(req.context, req.prompt - 1) // bt
        plan = self._plans[req.session_id]
        reuse = mem.resident(req.session_id, hist_blocks) if plan.reuse_kv else []
        full = next((i for i, k in enumerate(reuse) if k < groups), len(reuse))
        tier, load_blocks, load_bytes = None, 0, 0
        if plan.reuse_kv and not plan.device_only and full < hist_blocks:
            tier = self._source(node.node_id, req.session_id, hist_blocks * bt, plan.pull_from)
            if tier is not None:
                load_blocks = hist_blocks - full
                missing = sum(groups - k for k in reuse[full:]) + groups * (
                    hist_blocks - len(reuse))
                load_bytes = missing * bt * cal.kv_bytes_per_token // groups
                if cal.load_s(tier, load_bytes) > cal.prefill_s_per_token * load_blocks * bt:
                    tier, load_blocks, load_bytes = None, 0, 0  # recomputing is cheaper
        if tier is None:
            reuse = reuse[:full]  # partial blocks are no use without their upper layers
        table = mem.take(req.session_id, reuse, total_blocks)
        if table is None:
            return False
        req.table = table
        req.cached = (full + load_blocks) * bt
        req.to_compute = max(1, req.prompt - req.cached)
        self.bytes_by_tier[DEVICE] += full * bt * cal.kv_bytes_per_token
        if tier is not None:
            self.bytes_by_tier[tier] += load_bytes
            seconds = cal.load_s(tier, load_bytes)
            if self.layerwise:
                req.load_until = now + seconds
            else:
                req.ready_at = now + seconds
        return True

    def _finished(self, node: SimNode, req: Req, now: float) -> None:
        mem, tokens = self.memory[node.node_id], req.prompt + req.out
        plan = self._plans.pop(req.session_id)
        if plan.reuse_kv:
            mem.release(req.session_id, req.table, tokens // self.cal.block_tokens)
            if not plan.device_only:  # (``prefix``: KV only on the device)
                self._save(node.node_id, req.session_id, tokens)
        else:
            mem.forget(req.session_id, req.table)
        self.registry.end(node.node_id)
        self.sessions.turn_served(TENANT, req.session_id, node.node_id, tokens)
        sent = req.sent_at
        self.results.append(Result(req.session_id, req.turn, req.advised, req.priority,
                                   sent, req.first_at - sent, now - sent, req.out,
                                   req.cached, node.node_id))
        session = self._index[req.session_id]
        self._shift[req.session_id] += now - sent
        if req.turn + 1 < len(session.turns):
            self._turn_events(session, req.turn + 1)
        else:
            self._open -= 1


def simulate(trace: Trace, *, policy: str, nodes: int, calibration: Calibration,
             time_scale: float = 1.0, max_answer_tokens: int = 1024, cooperative: bool = True,
             purge_order: str = "layers", layerwise: bool = True, seed: int = 0,
             move_tokens: int = MOVE_TOKENS) -> SimOutcome:
    """Replay ``trace`` on a simulated cluster of ``nodes`` engines under ``policy``.

    Deterministic: ``seed`` is accepted for the runner's symmetry (the trace carries all
    randomness; ties are broken by event order)."""
    del seed
    return Simulator(trace, policy=policy, nodes=nodes, calibration=calibration,
                     time_scale=time_scale, max_answer_tokens=max_answer_tokens,
                     cooperative=cooperative, purge_order=purge_order,
                     layerwise=layerwise, move_tokens=move_tokens).run()
