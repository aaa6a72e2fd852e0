"""The tools' learnt latencies behind inferred advisories (issue 41): the median is the
next turn's expected arrival, a high percentile its expiry; per tenant and tool."""

from __future__ import annotations

from services.scheduler.advisory import ToolLatencies


def test_not_learnt_yet_the_default_and_the_books_ttl() -> None:
    lat = ToolLatencies(default_s=2.0)
    e = lat.expected("t", ("search",))
    assert e.arrival_s == 2.0 and e.expiry_s == 0.0
    lat.observe("t", ("search",), 1.0)
    lat.observe("t", ("search",), 1.0)
    assert lat.expected("t", ("search",)).expiry_s == 0.0  # two gaps: not enough


def test_median_for_arrival_high_percentile_for_expiry_slowest_tool_wins() -> None:
    lat = ToolLatencies(default_s=2.0, quantile=0.9, window=10)
    for gap in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 30.0):
        lat.observe("t", ("search",), gap)
    for gap in (0.3, 0.4, 0.5):
        lat.observe("t", ("calc",), gap)
    e = lat.expected("t", ("search",))
    assert e.arrival_s == 5.5 and e.expiry_s == 30.0
    assert lat.expected("t", ("calc",)).arrival_s == 0.4
    both = lat.expected("t", ("calc", "search"))  # parallel calls: the slowest
    assert both.arrival_s == 5.5 and both.expiry_s == 30.0
    assert lat.expected("other", ("search",)).arrival_s == 2.0  # tenants learn apart
    for _ in range(10):  # a window: old gaps are forgotten
        lat.observe("t", ("search",), 1.0)
    assert lat.expected("t", ("search",)).arrival_s == 1.0
