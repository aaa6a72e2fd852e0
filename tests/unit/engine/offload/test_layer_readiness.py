"""LayerReadiness: per-layer waits from a worker thread, failures that cover later layers."""

from __future__ import annotations

import threading

import pytest

from services.engine.layer_readiness import LayerReadiness


def test_layers_become_ready_in_order() -> None:
    r = LayerReadiness(3)
    r.mark_loaded(0)
    assert r.wait(0, timeout=0) and not r.complete
    r.mark_loaded(1)
    r.mark_loaded(2)
    assert r.wait(2, timeout=0) and r.complete and not r.failed


def test_wait_blocks_until_the_layer_arrives_from_another_thread() -> None:
    r = LayerReadiness(2)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(r.wait(1, timeout=5)))
    t.start()
    r.mark_loaded(0)
    assert t.is_alive() or got == []  # layer 1 is not there yet
    r.mark_loaded(1)
    t.join(5)
    assert got == [True]


def test_failure_covers_that_layer_and_later_ones() -> None:
    r = LayerReadiness(4)
    r.mark_loaded(0)
    r.mark_loaded(1)
    r.fail(2, "chunk corrupt")
    assert r.wait(1, timeout=0)  # loaded before the failure: still fine
    assert not r.wait(2, timeout=0) and not r.wait(3, timeout=0)
    assert r.failed and not r.complete and r.error == "chunk corrupt"
    r.mark_loaded(2)  # too late: a failure is final
    assert not r.wait(2, timeout=0)


def test_failure_wakes_a_waiting_thread() -> None:
    r = LayerReadiness(2)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(r.wait(1, timeout=5)))
    t.start()
    r.fail(0, "rpc failed")
    t.join(5)
    assert got == [False]


def test_timeout_counts_as_failure_and_out_of_order_is_a_failure() -> None:
    r = LayerReadiness(3)
    assert not r.wait(0, timeout=0.01)
    assert r.failed and "not loaded within" in r.error
    r2 = LayerReadiness(3)
    r2.mark_loaded(1)  # layer 0 skipped
    assert not r2.wait(0, timeout=0) and r2.failed


def test_finish_before_all_layers_fails_the_rest() -> None:
    r = LayerReadiness(3)
    r.mark_loaded(0)
    r.finish()
    assert r.finished and r.wait(0, timeout=0) and not r.wait(1, timeout=0)
    done = LayerReadiness(1)
    done.mark_loaded(0)
    done.finish()
    assert done.complete and not done.failed


def test_rejects_no_layers() -> None:
    with pytest.raises(ValueError):
        LayerReadiness(0)
