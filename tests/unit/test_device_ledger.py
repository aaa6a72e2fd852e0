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
