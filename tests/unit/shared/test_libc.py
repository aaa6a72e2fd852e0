from __future__ import annotations

from services.kvstore.malloc_tuning import tune_malloc
from shared.libc import glibc, trim_heap


def test_glibc_controls_are_reachable() -> None:
    assert glibc() is not None  # the project's machines run Debian (glibc)
    big = [bytearray(1 << 20) for _ in range(64)]  # 64 MiB on the heap, then freed
    del big
    assert isinstance(trim_heap(), bool)
    assert tune_malloc()


def test_without_glibc_every_call_is_a_no_op(monkeypatch) -> None:
    import shared.libc as libc

    monkeypatch.setattr(libc.ctypes.util, "find_library", lambda name: None)
    libc.glibc.cache_clear()
    try:
        assert libc.glibc() is None
        assert libc.trim_heap() is False
        assert tune_malloc() is False
    finally:
        libc.glibc.cache_clear()
