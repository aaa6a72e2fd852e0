"""``overture demo-model PATH --several N --share F``: fine-tunes of one base whose
engine tensors are partly identical (the Reuse Store holds those once), and the store as
the ``ResidencySource`` the scheduler's placement reads."""

from __future__ import annotations

from pathlib import Path

from services.cli import main as cli_main
from services.nodemgr.reuse_store import ReuseStore, ShmArena, index_model
from shared.model_residency import ResidencySource


def test_several_models_share_a_fraction(tmp_path: Path) -> None:
    assert cli_main(["demo-model", str(tmp_path), "--several", "3", "--share", "0.5"]) == 0
    paths = sorted(tmp_path.glob("tiny-share-*"))
    assert [p.name for p in paths] == ["tiny-share-1", "tiny-share-2", "tiny-share-3"]
    idx = [index_model(p.name, p, "float32") for p in paths]
    for a, b in ((0, 1), (0, 2), (1, 2)):
        common = set(idx[a].unique()) & set(idx[b].unique())
        frac = sum(idx[a].unique()[k] for k in common) / idx[a].total_bytes
        assert 0.4 <= frac <= 0.7, frac  # (whole tensors: about the half asked for)
    assert cli_main(["demo-model", str(tmp_path), "--several", "2", "--share", "2"]) == 2

    arena = ShmArena(4 << 20, str(tmp_path))
    try:
        store = ReuseStore(arena, dtype="float32")
        for i in idx:
            store.add_index(i)
        source: ResidencySource = store
        store.plan("tiny-share-1")
        store.committed("tiny-share-1", 0.01)
        got = {r.model: r for r in source.residency()}
        assert got["tiny-share-1"].missing_bytes == 0 and got["tiny-share-1"].active
        assert 0 < got["tiny-share-2"].resident_bytes < got["tiny-share-2"].total_bytes
        assert not got["tiny-share-2"].active
        assert source.load_bytes_per_s() > 0
    finally:
        arena.close()
