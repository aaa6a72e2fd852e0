"""Where each session's KV is (``SessionDirectory``): recorded at a turn's end, refined by
the node's save reports, bounded by LRU and TTL."""

from __future__ import annotations

from services.scheduler.cluster import SessionDirectory
from tests.unit.scheduler.conftest import Clock


def test_a_turn_records_its_node_and_length_and_a_save_adds_what_landed() -> None:
    d = SessionDirectory(10, 60.0, Clock())
    d.turn_served("t", "s", "node0", 120)
    d.saved("t", "s", "node0", 119)
    place = d.where("t", "s")
    assert place is not None
    assert (place.node_id, place.turn_tokens, place.saved_tokens) == ("node0", 120, 119)
    assert d.where("other-tenant", "s") is None


def test_a_late_save_report_of_an_older_node_is_ignored() -> None:
    d = SessionDirectory(10, 60.0, Clock())
    d.turn_served("t", "s", "node0", 100)
    d.turn_served("t", "s", "node1", 150)  # the next turn ran on node1
    d.saved("t", "s", "node0", 99)  # node0's save of the first turn lands late
    place = d.where("t", "s")
    assert place is not None and place.node_id == "node1" and place.saved_tokens == 0


def test_a_save_of_an_unknown_session_is_learnt_after_a_restart() -> None:
    d = SessionDirectory(10, 60.0, Clock())
    d.saved("t", "s", "node1", 80)
    place = d.where("t", "s")
    assert place is not None and (place.node_id, place.saved_tokens) == ("node1", 80)


def test_least_recently_used_sessions_go_first_past_capacity() -> None:
    d = SessionDirectory(2, 60.0, Clock())
    d.turn_served("t", "a", "n", 1)
    d.turn_served("t", "b", "n", 1)
    assert d.where("t", "a") is not None  # a is now the most recent
    d.turn_served("t", "c", "n", 1)
    assert d.where("t", "b") is None
    assert d.where("t", "a") is not None and d.where("t", "c") is not None
    assert len(d) == 2


def test_entries_expire_after_the_ttl() -> None:
    clock = Clock()
    d = SessionDirectory(10, 60.0, clock)
    d.turn_served("t", "s", "n", 1)
    clock.now += 59
    assert d.where("t", "s") is not None
    clock.now += 61
    assert d.where("t", "s") is None and len(d) == 0


def test_no_session_records_nothing_and_a_node_can_be_forgotten() -> None:
    d = SessionDirectory(10, 60.0, Clock())
    d.turn_served("t", "", "n", 5)
    d.saved("t", "", "n", 5)
    assert len(d) == 0
    d.turn_served("t", "a", "n0", 1)
    d.turn_served("t", "b", "n1", 1)
    assert d.forget_node("n0") == 1
    assert d.where("t", "a") is None and d.where("t", "b") is not None


def test_a_restarted_directory_takes_the_freshest_report_of_each_session() -> None:
    clock = Clock()
    clock.now = 1000.0
    d = SessionDirectory(10, 60.0, clock)
    assert d.restore("t", "s", "node0", 40, age_s=5.0)
    assert d.restore("t", "s", "node1", 64, age_s=1.0)  # moved there since
    assert not d.restore("t", "s", "node0", 40, age_s=5.0)  # (node0 registering again)
    place = d.where("t", "s")
    assert place is not None and (place.node_id, place.saved_tokens) == ("node1", 64)
    d.turn_served("t", "s", "node0", 80)  # a turn after the restart is newer than any save
    assert not d.restore("t", "s", "node1", 64, age_s=0.0)
    assert d.where("t", "s").node_id == "node0"
    assert not d.restore("t", "old", "node0", 10, age_s=61.0)  # past the TTL
    assert d.where("t", "old") is None and d.where("u", "s") is None
