from __future__ import annotations

import pytest

from services.kvstore.metrics import KVStoreMetrics


def test_loop_counters_export_like_prometheus_counters() -> None:
    m = KVStoreMetrics()
    m.hits.labels("dram").inc()
    m.hits.labels("dram").inc()
    m.bytes_in.labels("ssd").inc(4096)
    assert m.value("kvstore_hits_total", tier="dram") == 2
    assert m.value("kvstore_bytes_in_total", tier="ssd") == 4096
    assert m.value("kvstore_misses_total", tier="dram") == 0
    text = m.render().decode()
    assert "# TYPE kvstore_hits_total counter" in text
    assert 'kvstore_hits_total{tier="dram"} 2.0' in text
    assert 'kvstore_bytes_in_total{tier="ssd"} 4096.0' in text


def test_loop_counter_needs_its_labels() -> None:
    m = KVStoreMetrics()
    with pytest.raises(ValueError):
        m.hits.labels()
    with pytest.raises(ValueError):
        m.hits.labels("dram", "extra")
