"""Fixtures the kvstore unit tests share."""

from __future__ import annotations

import time

import pytest


@pytest.fixture
def slow_ssd_reads(monkeypatch: pytest.MonkeyPatch):
    """SSD reads on threads that take 0.2 s once the file is open (the old version)."""
    from services.kvstore.tiers import ssd as ssd_mod
    from services.kvstore.tiers import ssd_files

    real = ssd_mod.apply_check

    def slow(*a):
        time.sleep(0.2)
        return real(*a)

    monkeypatch.setattr(ssd_mod, "apply_check", slow)  # blob files
    monkeypatch.setattr(ssd_files, "apply_check", slow)  # values kept in the catalog
