"""A tool call's session (issue 41): the turn answering a call belongs to the session
that made it, per tenant, bounded."""

from __future__ import annotations

from services.scheduler.cluster import ToolCallSessions


def test_the_answer_to_a_call_finds_the_session_that_made_it() -> None:
    calls = ToolCallSessions(capacity=3)
    calls.record("t", ["call_a", "call_b"], "s1")
    calls.record("t", ["call_c"], "s2")
    calls.record("t", ["call_x"], "")  # no session: nothing to remember
    assert calls.session_of("t", ["call_b"]) == "s1"
    assert calls.session_of("t", ["call_a", "call_c"]) == "s2"  # the latest call wins
    assert calls.session_of("u", ["call_a"]) == ""  # another tenant's call names nothing
    assert calls.session_of("t", ["call_zz"]) == ""
    calls.record("t", ["call_d"], "s3")  # capacity 3: the least recently used goes
    assert len(calls) == 3 and calls.session_of("t", ["call_a"]) == ""
