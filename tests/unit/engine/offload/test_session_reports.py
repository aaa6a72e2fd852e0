"""What the engine tells the scheduler about sessions: saves that landed (numbered, for
the node manager to forward once) and where a turn's reused KV came from."""

from __future__ import annotations

import time

from services.engine.offload.loads import loaded_from
from services.engine.offload.save_log import SaveLog
from services.engine.reuse_plan import ReusePlan
from shared.kv_layout import KVSpan
from shared.session_key import SessionKey


def test_saves_are_numbered_and_read_after_the_last_acknowledged() -> None:
    log = SaveLog(capacity=3)
    assert log.after(0) == ()
    for i in range(4):
        log.record(SessionKey("t", f"s{i}"), 10 * i)
    entries = log.after(0)
    assert [e.session.session_id for e in entries] == ["s1", "s2", "s3"]  # the oldest went
    assert [e.session.session_id for e in log.after(entries[0].seq)] == ["s2", "s3"]
    assert log.after(entries[-1].seq) == ()
    # A restarted engine numbers above anything the one before it reported.
    time.sleep(0.01)
    restarted = SaveLog()
    restarted.record(SessionKey("t", "s"), 1)
    assert restarted.after(entries[-1].seq)[0].session.session_id == "s"


def test_a_load_is_named_by_its_farthest_source() -> None:
    def plan(*tiers: str) -> ReusePlan:
        spans = tuple(KVSpan(bytes([i]), 16 * i, 16, t, 1) for i, t in enumerate(tiers))
        return ReusePlan(spans, "lease", 0, 16 * len(tiers))

    assert loaded_from(plan("dram", "ssd")) == "local"
    assert loaded_from(plan("dram", "s3")) == "s3"
    assert loaded_from(plan("dram", "peer", "s3")) == "peer"
