"""The transfer engine in the forward (MIRAGE §4.1, §5.4): remapped layers computed in
slots their weights are copied into by a worker thread give the unremapped model's
tokens, at every α and in both schemes; and the engine end to end: a sequence that needs
the lent pages completes, and the weights come back after the burst."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.engine.api_types import GenerateRequest, SamplingParams
from services.engine.config import EngineConfig, RemapConfig
from services.engine.engine_core import EngineCore
from services.engine.model import LoadedModel, load_model, write_demo_model
from services.engine.model.linear import Linear
from services.engine.model.mapped import StoredTensor, StoredWeights, load_mapped
from services.engine.remap import (
    LayerStreamer,
    Remapper,
    ThreadCopier,
    host_tensors,
    layer_bytes,
    plan_layers,
)
from services.engine.validation import prepare
from services.nodemgr.reuse_store import ReuseStore, ShmArena, index_model

PROMPTS = ["Once upon a time, in a land far away, there lived a king.",
           "1 2 3 4 5 6 7 8 9 10 11 12", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """Four layers: room for α up to 2 with two slots."""
    path = write_demo_model(tmp_path_factory.mktemp("model") / "deep", size="tiny-deep")
    return load_model(path, dtype=torch.float32)


def core_for(loaded: LoadedModel, budget: int = 4 << 20, **remap: object) -> EngineCore:
    cfg = EngineConfig(dtype="float32", device_memory_bytes=budget, page_bytes=16 << 10,
                       debug_checks=True, remap=RemapConfig(**remap))  # type: ignore[arg-type]
    return EngineCore(cfg, loaded)


def add(core: EngineCore, loaded: LoadedModel, rid: str, prompt: str, n: int = 10) -> None:
    req = GenerateRequest(request_id=rid, prompt=prompt,
                          sampling=SamplingParams(max_tokens=n, ignore_eos=True))
    core.add(prepare(req, tokenizer=loaded.tokenizer, model_name=loaded.name,
                     vocab_size=loaded.config.vocab_size, max_model_len=core.max_model_len,
                     fingerprint=loaded.fingerprint))


def run(core: EngineCore, each_step: object = None) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(500):
        if not core.has_work():
            break
        for ev in core.step():
            assert not hasattr(ev, "error"), ev
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
        if callable(each_step):
            each_step()
    return out


def generate(loaded: LoadedModel, streamer: LayerStreamer | None = None,
             plan: object = None) -> dict[str, list[int]]:
    core = core_for(loaded)
    try:
        if streamer is not None:
            streamer.install(plan)  # type: ignore[arg-type]
        for i, p in enumerate(PROMPTS):
            add(core, loaded, f"r{i}", p)
        return run(core)
    finally:
        if streamer is not None:
            streamer.install(plan_layers(0, loaded.config.num_layers))
        core.close()


@pytest.fixture
def streamer(deep: LoadedModel) -> Iterator[LayerStreamer]:
    s = LayerStreamer(deep.model, ThreadCopier())
    yield s
    s.close()
    assert deep.model.streamer is None


@pytest.mark.parametrize(("alpha", "scheme"), [(1, "single"), (2, "single"), (1, "double"),
                                               (2, "double")])
def test_greedy_tokens_equal_the_unremapped_models(
        deep: LoadedModel, streamer: LayerStreamer, alpha: int, scheme: str) -> None:
    want = generate(deep)
    plan = plan_layers(alpha, deep.config.num_layers, scheme=scheme)
    assert plan.m == alpha + (1 if scheme == "single" else 2)
    got = generate(deep, streamer, plan)
    assert got == want
    # every streamed layer was copied in on every step (m copies a forward)
    assert streamer.stats.transfers >= plan.m * len(want["r0"])


def test_a_forward_cut_short_never_computes_a_wrong_layer(
        deep: LoadedModel, streamer: LayerStreamer) -> None:
    want = generate(deep)
    plan = plan_layers(1, deep.config.num_layers, scheme="single")  # layers 0 and 2, one slot
    streamer.install(plan)
    streamer.release(0)  # as if layer 0 ran and the forward stopped: layer 2 is on its way
    streamer.acquire(2)
    try:
        core = core_for(deep)  # the next forward asks for layer 0 first: filled at once
        for i, p in enumerate(PROMPTS):
            add(core, deep, f"r{i}", p)
        assert run(core) == want
        core.close()
    finally:
        streamer.install(plan_layers(0, deep.config.num_layers))


def test_a_layers_host_copy_is_its_weights(deep: LoadedModel) -> None:
    layer = deep.model.decoder_layers[1]
    host = host_tensors(layer)
    assert isinstance(layer.qkv, Linear) and torch.equal(host["qkv_w"], layer.qkv.weight)
    cfg = deep.config
    per_layer = (cfg.q_size + 2 * cfg.kv_size) * cfg.hidden_size + cfg.q_size * cfg.hidden_size \
        + 3 * cfg.intermediate_size * cfg.hidden_size + 2 * cfg.hidden_size
    assert layer_bytes(layer) == per_layer * 4


LONG = " ".join(f"word{i}" for i in range(180))
OTHER = " ".join(f"term{i}" for i in range(180))  # no prefix shared with LONG


def test_a_sequence_that_needs_the_lent_pages_completes(deep: LoadedModel) -> None:
    """Two long sequences in a 1 MiB budget: the second fits only in lent pages. With
    remapping it runs beside the first, to the same tokens, and after the burst no
    weight bytes stay lent."""
    ref = core_for(deep)
    try:
        add(ref, deep, "a", LONG, 6)
        add(ref, deep, "b", OTHER, 6)
        want = run(ref)
    finally:
        ref.close()
    core = core_for(deep, budget=1 << 20, enabled=True, capped=False, scheme="double")
    seen = {"alpha": 0, "pages": 0, "both": False}

    def watch() -> None:
        assert core.remap is not None
        seen["alpha"] = max(seen["alpha"], core.pool.lent_bytes // core.remap.target.layer_bytes)
        seen["pages"] = max(seen["pages"], core.pool.num_committed_pages)
        seen["both"] = seen["both"] or len(core.scheduler.running) == 2

    try:
        assert core.remap is not None
        base = core.pool.base_pages
        need = core.kv.blocks_needed
        add(core, deep, "a", LONG, 6)
        add(core, deep, "b", OTHER, 6)
        a, b = (core._live[r].seq for r in ("a", "b"))
        assert need(a, a.num_tokens + 6) + need(b, b.num_tokens + 6) > core.pool.budget_blocks
        got = run(core, watch)
        assert got == want
        assert seen["alpha"] >= 1 and seen["pages"] > base and seen["both"]
        st = core.status().remap
        assert st is not None and st.remaps >= 1 and st.transfers > 0
        assert st.alpha == 0 and st.lent_bytes == 0 and core.pool.lent_bytes == 0
        assert st.reversions == st.remaps and deep.model.streamer is None
        assert core.pool.num_committed_pages <= base
    finally:
        core.close()


def test_remapping_off_the_second_sequence_waits(deep: LoadedModel) -> None:
    core = core_for(deep, budget=1 << 20)
    both = [False]
    try:
        assert core.remap is None
        add(core, deep, "a", LONG, 6)
        add(core, deep, "b", OTHER, 6)
        run(core, lambda: both.__setitem__(0, both[0] or len(core.scheduler.running) == 2))
        assert not both[0]
    finally:
        core.close()


class HeldPrefetch:
    """A device prefetch holding ``n`` blocks it would purge."""

    def __init__(self, n: int) -> None:
        self.n = n

    def reclaimable(self) -> int:
        return self.n

    def reclaim(self, n: int) -> int:
        return 0


@pytest.mark.parametrize(("give_way", "lends"), [("prefetch_first", False),
                                                 ("weights_first", True)])
def test_prefetched_kv_gives_way_before_weights_unless_configured_otherwise(
        deep: LoadedModel, give_way: str, lends: bool) -> None:
    core = core_for(deep, budget=1 << 20)
    try:
        free = core.blocks.num_available()
        cfg = RemapConfig(enabled=True, capped=False, give_way=give_way)
        r = Remapper(cfg, deep.model, "m", core.pool, core.blocks, lambda: free + 8,
                     HeldPrefetch(8), copier=ThreadCopier())
        r.before_step()  # 8 blocks short, and the prefetch holds 8 it can purge
        assert (r.stats().alpha == 1) is lends
        r.close()
        assert deep.model.streamer is None
    finally:
        core.close()


def test_a_model_mapped_from_the_reuse_store_streams_from_its_arena_views(
        deep: LoadedModel, tmp_path: Path) -> None:
    """The host copy of a remapped layer is the store's: no copy of the weights is made,
    and the tokens are the plain model's."""
    arena = ShmArena(4 << 20, str(tmp_path))
    try:
        store = ReuseStore(arena, dtype="float32")
        store.add_index(index_model("deep", deep.path, "float32"))
        plan = store.plan("deep")
        stored = StoredWeights(arena.path, arena.nbytes, "float32", tuple(
            StoredTensor(m.name, m.offset, m.nbytes, m.fill) for m in plan))
        mapped = load_mapped(deep.path, stored, torch.float32).loaded
        store.committed("deep", 0.0)
        layer = mapped.model.decoder_layers[2]
        assert isinstance(layer.qkv, Linear) and layer.qkv.w is not None
        assert host_tensors(layer)["qkv_w"].data_ptr() == layer.qkv.w.data_ptr()
        want = generate(deep)
        s = LayerStreamer(mapped.model, ThreadCopier())
        try:
            assert generate(mapped, s, plan_layers(2, 4, scheme="double")) == want
            assert s.stats.transfers > 0
        finally:
            s.close()
    finally:
        arena.close()


def test_remapping_metrics_are_exported(deep: LoadedModel) -> None:
    from services.engine.metrics import render_engine_metrics

    core = core_for(deep, budget=1 << 20, enabled=True, capped=False)
    try:
        assert core.remap is not None
        add(core, deep, "a", LONG, 2)
        add(core, deep, "b", OTHER, 2)
        for _ in range(5):  # once the first runs, the second prompt does not fit: a layer lent
            core.step()
            if core.remap.stats().alpha:
                break
        st = core.status()
        assert st.remap is not None and st.remap.alpha == 1
        assert st.device_budget_bytes == (1 << 20) + core.remap.target.layer_bytes
        text = render_engine_metrics(st).decode()
        for name, value in (("alpha", 1), ("lent_bytes", core.remap.target.layer_bytes),
                            ("layers_lent_total", 1)):
            assert f'overture_engine_remap_{name}{{model="{deep.name}"}} {float(value)}' in text
        for name in ("layers_streamed", "transfer_seconds_total", "stalled_steps_total",
                     "step_transfer_seconds", "layers_reverted_total"):
            assert f"overture_engine_remap_{name}" in text
        run(core)
    finally:
        core.close()
