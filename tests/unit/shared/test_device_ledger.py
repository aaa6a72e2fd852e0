"""The node's device ledger: a budget shared by processes, a slot each, crash-safe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.device_ledger import DeviceLedger, LedgerError, create_ledger


def test_takes_within_the_budget_and_gives_back(tmp_path: Path) -> None:
    path = create_ledger(tmp_path / "l", 1000)
    a, b = DeviceLedger(path), DeviceLedger(path)
    a.join("alpha")
    b.join("beta")
    assert a.take(600) and b.take(300, weights=True)
    assert not b.take(200)  # 1100 > 1000
    assert a.used_bytes() == b.used_bytes() == 900 and a.free_bytes() == 100
    a.give(600)
    assert b.take(200) and b.mine().kv_bytes == 200 and b.mine().weight_bytes == 300
    assert {h.label for h in a.holders()} == {"alpha", "beta"}
    b.close()
    assert a.used_bytes() == 0  # leaving frees what it held
    a.close()


def test_weights_lent_to_the_nodes_kv_show_and_come_back_once_free(tmp_path: Path) -> None:
    """MIRAGE §5.2 across a node: lent weight bytes leave the lender's weights row for
    the header's lent word; the reversion waits while another engine's KV holds them."""
    path = create_ledger(tmp_path / "l", 1000)
    idle, busy = DeviceLedger(path), DeviceLedger(path)
    idle.join("idle")
    busy.join("busy")
    assert idle.take(600, weights=True) and busy.take(400)
    assert not idle.lend(700)  # more than it holds
    assert idle.lend(200)
    assert idle.mine().weight_bytes == 400 and busy.lent_bytes() == 200
    assert busy.take(200)  # the busy engine's KV takes them
    assert not idle.unlend(200) and idle.lent_bytes() == 200  # still held by KV
    busy.give(200)
    assert idle.unlend(200) and idle.mine().weight_bytes == 600 and busy.lent_bytes() == 0
    idle.close()
    busy.close()


def test_a_reserve_holds_back_what_its_engine_does_not_hold_yet(tmp_path: Path) -> None:
    """Prism §6.3's buffer per engine: the others cannot take the unfilled part of a
    reserve; its owner can, and a filled reserve holds nothing back."""
    path = create_ledger(tmp_path / "l", 1000)
    hot, cold = DeviceLedger(path), DeviceLedger(path)
    hot.join("hot")
    cold.join("cold")
    assert hot.take(500)  # held before the reserve: a reserve takes nothing away
    cold.reserve(300)
    assert hot.available_bytes() == 200 and cold.available_bytes() == 500
    assert hot.take(200) and not hot.take(1)  # 700 used + 300 held back for cold
    assert cold.take(100, weights=True)  # weights do not fill a KV reserve
    assert hot.available_bytes() == 0 and cold.available_bytes() == 200
    hot.give(300)
    assert cold.take(250) and cold.mine().kv_bytes == 250
    assert hot.available_bytes() == 200  # 400 + 250 + 100 used, 50 held back
    assert cold.take(100)  # past its reserve: it competes like any other
    assert hot.available_bytes() == 150 and hot.take(150)
    assert [h.reserve_bytes for h in hot.holders()] == [0, 300]
    cold.reserve(0)
    cold.give(350)
    assert hot.available_bytes() == 350 == cold.available_bytes()
    cold.reserve(200)
    assert hot.available_bytes() == 150
    cold.close()  # leaving drops the reserve with the slot
    assert hot.available_bytes() == 450
    hot.close()


def test_reserves_beyond_the_budget_never_block_each_other(tmp_path: Path) -> None:
    """Two reserves of 800 in a budget of 1000: each engine fills its own reserve from what
    is free (first come, first served); none is locked out by the other's claim."""
    path = create_ledger(tmp_path / "l", 1000)
    a, b = DeviceLedger(path), DeviceLedger(path)
    a.join("a")
    b.join("b")
    a.reserve(800)
    b.reserve(800)
    assert a.take(600) and b.available_bytes() == 400 and b.take(400)
    assert not b.take(1) and not a.take(1)  # the budget is used up
    a.give(600)
    assert a.available_bytes() == 600  # its own reserve, all free
    assert not b.take(1, weights=True)  # weights never fill a reserve: a's claim holds
    assert a.take(600)
    a.close()
    b.close()


def test_a_dead_process_reserve_holds_nothing_back(tmp_path: Path) -> None:
    path = create_ledger(tmp_path / "l", 1000)
    mine = DeviceLedger(path)
    mine.join("here")  # slot 0: the dead one's slot is not taken over below
    code = (f"from shared.device_ledger import DeviceLedger\n"
            f"l = DeviceLedger({str(path)!r}); l.join('gone'); l.reserve(500)\n"
            "import os; os._exit(0)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.getcwd(),
                   env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert [h.reserve_bytes for h in mine.holders()] == [0, 500]  # still recorded
    assert mine.available_bytes() == 1000 and mine.take(1000)
    mine.close()


def test_a_dead_process_slot_is_reclaimed_with_its_bytes(tmp_path: Path) -> None:
    path = create_ledger(tmp_path / "l", 1000)
    code = (f"from shared.device_ledger import DeviceLedger\n"
            f"l = DeviceLedger({str(path)!r}); l.join('gone'); assert l.take(700)\n"
            "import os; os._exit(0)\n")  # (dies without leaving)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.getcwd(),
                   env={**os.environ, "PYTHONPATH": os.getcwd()})
    mine = DeviceLedger(path)
    assert mine.used_bytes() == 700  # still counted, until its slot is taken over
    mine.join("here")
    assert mine.used_bytes() == 0 and mine.take(900)
    mine.close()


def test_not_a_ledger(tmp_path: Path) -> None:
    (tmp_path / "x").write_bytes(b"\0" * 4096)
    with pytest.raises(LedgerError):
        DeviceLedger(tmp_path / "x")
    with pytest.raises(LedgerError):
        DeviceLedger(tmp_path / "missing")
