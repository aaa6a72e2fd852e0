"""Node registry: rotation by heartbeat freshness, problems and suspension (fake clock)."""

from __future__ import annotations

from services.scheduler.cluster import Load, ModelSpec, NodeInfo, NodeRegistry


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def info(node_id: str, *models: str) -> NodeInfo:
    return NodeInfo(node_id, f"127.0.0.1:{len(node_id)}", tuple(ModelSpec(m) for m in models))


def make() -> tuple[NodeRegistry, Clock]:
    clock = Clock()
    return NodeRegistry(heartbeat_timeout_s=3.0, clock=clock), clock


def test_node_leaves_rotation_after_missing_heartbeats() -> None:
    reg, clock = make()
    reg.register(info("a", "m"))
    assert [n.node_id for n in reg.healthy("m")] == ["a"]
    clock.t += 3.0
    assert reg.healthy("m")  # exactly at the timeout it still counts
    clock.t += 0.01
    assert reg.healthy("m") == []
    assert reg.models() == []
    assert [m.name for m in reg.models(healthy_only=False)] == ["m"]
    assert reg.heartbeat("a", Load(running=1)) is True
    assert [n.node_id for n in reg.healthy()] == ["a"]
    reg.check_integrity()


def test_sweep_reports_transitions_once() -> None:
    reg, clock = make()
    reg.register(info("a", "m"))
    reg.register(info("b", "m"))
    assert reg.sweep() == ([], ["a", "b"])
    assert reg.sweep() == ([], [])
    clock.t += 2.0
    reg.heartbeat("b", Load())
    clock.t += 2.0
    assert reg.sweep() == (["a"], [])
    reg.heartbeat("a", Load())
    assert reg.sweep() == ([], ["a"])


def test_unknown_node_heartbeat_asks_to_register() -> None:
    reg, _ = make()
    assert reg.heartbeat("ghost", Load()) is False
    reg.register(info("a", "m"))
    reg.remove("a")
    assert reg.heartbeat("a", Load()) is False


def test_reported_problem_takes_node_out_until_cleared() -> None:
    reg, _ = make()
    reg.register(info("a", "m"))
    reg.heartbeat("a", Load(problem="engine unreachable"))
    assert reg.healthy() == []
    reg.heartbeat("a", Load())
    assert len(reg.healthy()) == 1


def test_suspension_ignores_stale_beats() -> None:
    reg, clock = make()
    reg.register(info("a", "m"))
    reg.suspend("a", grace_s=1.0)
    assert reg.healthy() == []
    clock.t += 0.5
    reg.heartbeat("a", Load())  # sent before the failure was noticed: not trusted
    assert reg.healthy() == []
    clock.t += 0.6
    reg.heartbeat("a", Load(problem="engine down"))
    assert reg.healthy() == []
    reg.heartbeat("a", Load())
    assert len(reg.healthy()) == 1


def test_reregistration_keeps_in_flight_counts() -> None:
    reg, _ = make()
    reg.register(info("a", "m"))
    reg.begin("a")
    reg.begin("a")
    reg.end("a")
    reg.register(info("a", "m", "m2"))
    node = reg.get("a")
    assert node is not None and node.routed == 1
    assert [m.name for m in reg.models()] == ["m", "m2"]
    reg.end("a")
    reg.end("a")  # never below zero
    assert node.routed == 0
    reg.check_integrity()


def test_healthy_filters_by_model() -> None:
    reg, _ = make()
    reg.register(info("a", "m1"))
    reg.register(info("b", "m2"))
    assert [n.node_id for n in reg.healthy("m2")] == ["b"]
    assert reg.healthy("m3") == []
