"""The core's side of loads and saves with a scripted transport (no kvstore): a load that
never answers falls back to recomputation, its blocks stay parked until the RPC ends; a
save pins blocks until unpinned."""

from __future__ import annotations

import pytest
import torch

from services.engine.api_types import GenerateRequest, SamplingParams
from services.engine.config import EngineConfig, OffloadConfig
from services.engine.engine_core import EngineCore
from services.engine.model import LoadedModel
from services.engine.offload import KVTransport, LoadJob, SaveJob, offload_for
from services.engine.reuse_plan import ReusePlan
from services.engine.validation import prepare
from shared.kv_layout import KVSpan

PROMPT = "Once upon a time, in a land far away, there lived a king who had three daughters. " * 2


class ScriptedTransport:
    def __init__(self) -> None:
        self.loads: list[LoadJob] = []
        self.saves: list[SaveJob] = []
        self.released: list[str] = []

    def start_load(self, job: LoadJob) -> None:
        self.loads.append(job)  # never answers by itself

    def start_save(self, job: SaveJob) -> None:
        self.saves.append(job)

    def release(self, lease_id: str) -> None:
        self.released.append(lease_id)


def make_core(loaded: LoadedModel, transport: KVTransport | None = None,
              **kw: object) -> EngineCore:
    """A core whose offload is the kvstore's, reached through ``transport`` (a scripted
    one that never answers by default), built as the engine's KVStoreLink builds it."""
    cfg = EngineConfig(dtype="float32", device_memory_bytes=4 << 20, page_bytes=16 << 10,
                       debug_checks=True, offload=OffloadConfig(load_timeout_s=0.05), **kw)
    t = transport if transport is not None else ScriptedTransport()
    return EngineCore(cfg, loaded, offload=lambda kv, scheduler, pool: offload_for(
        cfg, kv, scheduler, pool.block_bytes, t))


def scripted_core(loaded: LoadedModel) -> tuple[EngineCore, ScriptedTransport]:
    t = ScriptedTransport()
    return make_core(loaded, t), t


def two_block_plan(lease_id: str) -> ReusePlan:
    """Load the prompt's first two blocks from DRAM under ``lease_id``."""
    return ReusePlan((KVSpan(b"h", 0, 2, "dram", 1),), lease_id, 0, 2)


def add(core: EngineCore, loaded: LoadedModel, rid: str, plan: ReusePlan | None) -> None:
    req = GenerateRequest(request_id=rid, prompt=PROMPT, session_id="s",
                          sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    core.add(prepare(req, tokenizer=loaded.tokenizer, model_name=loaded.name,
                     vocab_size=loaded.config.vocab_size, max_model_len=core.max_model_len,
                     fingerprint=loaded.fingerprint), plan)


def run(core: EngineCore) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(100):
        if not core.has_work():
            break
        for ev in core.step():
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
    return out


def assert_all_let_go(core: EngineCore, t: ScriptedTransport) -> None:
    """Once the saves are answered (and loads ended), the next step frees every block."""
    for job in t.saves:
        core.offload.unpin(job.job_id)
    core.step()
    assert core.offload.held_blocks() == [] and core.blocks.num_used == 0
    core.check_integrity()


def test_load_that_never_answers_falls_back_and_parks_its_blocks(loaded: LoadedModel) -> None:
    ref = make_core(loaded)
    try:
        add(ref, loaded, "r", None)
        want = run(ref)["r"]
    finally:
        ref.close()
    core, t = scripted_core(loaded)
    try:
        plan = two_block_plan("lease-1")
        add(core, loaded, "a", plan)
        assert core.step() == []  # the wait timed out: no token sampled for garbage KV
        assert len(t.loads) == 1 and core.offload.loads.load_failures == 1
        parked = core.offload.held_blocks()
        assert sorted(parked) == sorted(t.loads[0].block_ids)  # 2 blocks x 2 layers
        assert all(core.blocks.refcount[b] >= 1 for b in parked)
        core.check_integrity()
        got = run(core)["a"]
        assert got == want  # recomputed from scratch
        assert core.offload.held_blocks() and t.saves  # still parked; the save is pinned
        t.loads[0].readiness.finish()  # the RPC ends at last
        assert_all_let_go(core, t)
    finally:
        core.close()


def test_a_failed_load_comes_back_as_an_id_for_the_core_to_requeue(
    loaded: LoadedModel,
) -> None:
    """The offload never calls the scheduler: ``after_forward`` returns the ids of the
    requests whose load failed, and the core requeues them."""
    core, t = scripted_core(loaded)
    try:
        add(core, loaded, "a", two_block_plan("lease-1"))
        out = core.scheduler.schedule()
        with core.offload.forward(out) as wait_for_layer:
            assert wait_for_layer is not None
            (job,) = t.loads
            job.readiness.fail(0, "chunk missing")  # the kvstore's answer
        seq = core._live["a"].seq
        assert core.offload.after_forward(out, 0.01) == ["a"]
        assert seq in core.scheduler.running and not out.empty  # nothing requeued yet
        core.scheduler.requeue(seq, out)  # what the core's step does with the id
        assert out.empty and core.scheduler.waiting[0] is seq
        job.readiness.finish()  # the RPC ends: its parked blocks go at the next step
        run(core)
        assert_all_let_go(core, t)
    finally:
        core.close()


def test_save_pins_full_blocks_until_unpinned(loaded: LoadedModel) -> None:
    core, t = scripted_core(loaded)
    try:
        add(core, loaded, "a", None)
        run(core)
        (job,) = t.saves
        seq_blocks = len(job.block_hashes)
        assert job.first_block == 0 and job.session.session_id == "s"
        assert len(job.block_ids) == seq_blocks * loaded.config.num_layers
        assert core.blocks.num_used == len(job.block_ids)  # pinned after the request ended
        core.check_integrity()
        core.offload.unpin(job.job_id)
        assert core.blocks.num_used == 0 and core.blocks.num_evictable >= len(job.block_ids)
    finally:
        core.close()


def test_plan_dropped_at_admission_releases_its_lease(loaded: LoadedModel) -> None:
    core, t = scripted_core(loaded)
    try:
        add(core, loaded, "warm", None)
        run(core)
        for job in t.saves:
            core.offload.unpin(job.job_id)
        # Everything the plan names is on device by admission: nothing to load.
        add(core, loaded, "b", two_block_plan("lease-2"))
        run(core)
        assert t.released == ["lease-2"] and len(t.loads) == 0
        add(core, loaded, "c", two_block_plan("lease-3"))
        core.abort("c")  # aborted while waiting
        assert t.released[-1] == "lease-3"
    finally:
        core.close()


class AnsweringTransport(ScriptedTransport):
    """Answers each save as it is made: stored, or (those in ``fail``) not stored."""

    def __init__(self, fail: set[int] = frozenset()) -> None:
        super().__init__()
        self.fail = fail
        self.core: EngineCore | None = None  # (set once built: the core is built with it)

    def start_save(self, job: SaveJob) -> None:
        super().start_save(job)
        assert self.core is not None
        self.core.unpin(job.job_id, ok=len(self.saves) - 1 not in self.fail)


def long_generation(loaded: LoadedModel, fail: set[int] = frozenset(), answer: bool = True
                    ) -> tuple[EngineCore, list[SaveJob]]:
    """A 90-token generation in 32-token chunks; saves answered at once (those in ``fail``
    storing nothing), or with ``answer=False`` never."""
    t = AnsweringTransport(fail) if answer else ScriptedTransport()
    core = make_core(loaded, t)
    if isinstance(t, AnsweringTransport):
        t.core = core
    core.kvstore_attached(2)  # 32-token chunks
    req = GenerateRequest(request_id="g", prompt=PROMPT, session_id="s",
                          sampling=SamplingParams(max_tokens=90, ignore_eos=True))
    core.add(prepare(req, tokenizer=loaded.tokenizer, model_name=loaded.name,
                     vocab_size=loaded.config.vocab_size, max_model_len=core.max_model_len,
                     fingerprint=loaded.fingerprint))
    run(core)
    return core, t.saves


def covered(saves: list[SaveJob], layers: int) -> list[int]:
    out = []
    for job in saves:
        assert job.first_block % 2 == 0
        assert len(job.block_ids) == layers * (len(job.block_hashes) - job.first_block)
        out.extend(range(job.first_block, len(job.block_hashes)))
    return out


def test_long_generation_saves_chunks_as_they_fill(loaded: LoadedModel) -> None:
    core, saves = long_generation(loaded)
    try:
        assert len(saves) >= 3  # several during generation, then the rest at the end
        assert covered(saves, loaded.config.num_layers) == list(
            range(len(saves[-1].block_hashes)))  # each block once
        assert all(len(j.block_hashes) % 2 == 0 for j in saves[:-1])  # whole chunks
        assert core.blocks.num_used == 0
        core.check_integrity()
    finally:
        core.close()


def test_a_failed_save_is_made_again_by_the_next_one(loaded: LoadedModel) -> None:
    """A mid-generation save that stored nothing leaves no gap: the next save starts where
    it did (else every later chunk would be stored yet unreachable)."""
    core, saves = long_generation(loaded, fail={0})
    try:
        assert saves[1].first_block == saves[0].first_block == 0
        blocks = covered(saves[1:], loaded.config.num_layers)  # what the stored saves hold
        assert blocks == list(range(len(saves[-1].block_hashes)))
        assert core.blocks.num_used == 0
        core.check_integrity()
    finally:
        core.close()


def test_the_last_save_covers_saves_not_answered_yet(loaded: LoadedModel) -> None:
    """A save still unanswered when the request ends may yet fail: the request's last
    save starts at the first block such a save holds."""
    core, saves = long_generation(loaded, answer=False)
    try:
        assert len(saves) >= 3 and saves[-1].first_block == 0
        for job in saves:
            core.offload.unpin(job.job_id)
        assert core.blocks.num_used == 0
        core.check_integrity()
    finally:
        core.close()


class PrefilledTransport(ScriptedTransport):
    """Reports layers resident as soon as the load starts (KV content irrelevant): all of
    them, or all but the last, whose wait then times out (the copy is still going until
    then)."""

    def __init__(self, all_layers: bool) -> None:
        super().__init__()
        self.all_layers = all_layers

    def start_load(self, job: LoadJob) -> None:
        super().start_load(job)
        n = job.readiness.num_layers
        for layer in range(n if self.all_layers else n - 1):
            job.readiness.mark_loaded(layer)
        if self.all_layers:
            job.readiness.finish()


@pytest.mark.parametrize("copy_done", [False, True])
def test_layers_overlapping_a_cpu_pool_copy_leave_a_core_to_it(
    loaded: LoadedModel, copy_done: bool
) -> None:
    before = torch.get_num_threads()
    full = max(2, before)  # a team to take a thread from, even on a 1-core machine
    torch.set_num_threads(full)
    core = make_core(loaded, PrefilledTransport(all_layers=copy_done))
    seen: list[int] = []
    make_waiter = core.offload.loads.waiter

    def waiter(loading):
        wait = make_waiter(loading)

        def wait_and_look(layer: int) -> None:
            wait(layer)
            seen.append(torch.get_num_threads())

        return wait_and_look

    core.offload.loads.waiter = waiter
    try:
        add(core, loaded, "a", two_block_plan("lease-1"))
        core.step()
        assert len(seen) == loaded.config.num_layers
        if copy_done:
            assert set(seen) == {full}
        else:  # the last layer's wait timed out: a failed load leaves no copy to make room for
            assert set(seen[:-1]) == {full - 1} and seen[-1] == full
        assert torch.get_num_threads() == full  # restored after the step
    finally:
        torch.set_num_threads(before)
        core.close()


def test_a_failed_step_parks_the_blocks_its_loads_may_still_write(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forward pass raises (say, out of memory) while a load is under way: aborting the
    requests must not hand the load's target blocks to anyone before its RPC has ended."""
    core, t = scripted_core(loaded)
    try:
        plan = two_block_plan("lease-1")
        add(core, loaded, "a", plan)

        def boom(*a: object, **kw: object) -> None:
            raise RuntimeError("out of memory")

        monkeypatch.setattr(core.runner, "execute", boom)
        with pytest.raises(RuntimeError):
            core.step()
        (job,) = t.loads
        core.abort_all()  # what the engine does with a failed step
        targets = list(job.block_ids)
        assert sorted(core.offload.held_blocks()) == sorted(targets)
        assert all(core.blocks.refcount[b] == 1 for b in targets)  # held, not free
        monkeypatch.undo()
        add(core, loaded, "b", None)
        run(core)  # another request runs meanwhile, in other blocks
        assert all(core.blocks.refcount[b] >= 1 for b in targets)
        job.readiness.finish()  # the load's RPC ends
        assert_all_let_go(core, t)
    finally:
        core.close()


def test_a_request_that_can_never_get_blocks_gives_its_lease_back(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    core, t = scripted_core(loaded)
    try:
        add(core, loaded, "b", two_block_plan("lease-9"))
        monkeypatch.setattr(core.kv, "allocate", lambda *a, **kw: False)  # no pages to commit
        events = core.step()
        assert [type(e).__name__ for e in events] == ["Failure"]
        assert t.released == ["lease-9"]
    finally:
        core.close()
