"""The core's offload boundary: the named points it calls, in order, and ``NullOffload``
(device-only and recompute runs) that loads and saves nothing but still reports hits."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from services.engine.engine_core import EngineCore
from services.engine.model import LoadedModel
from services.engine.offload import LayerWait, NullOffload
from services.engine.scheduler import SchedulerOutput
from services.engine.sequence import Sequence

from .test_kvstore_offload import (
    add,
    make_core,
    run,
    two_block_plan,
)


class Recording(NullOffload):
    """A NullOffload that writes down every call the core makes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def begin_step(self) -> None:
        self.calls.append("begin_step")

    @contextmanager
    def forward(self, out: SchedulerOutput) -> Iterator[LayerWait | None]:
        self.calls.append("forward")
        with super().forward(out) as wait:
            yield wait
        self.calls.append("forward done")

    def after_forward(self, out: SchedulerOutput, seconds: float) -> list[str]:
        self.calls.append("after_forward")
        return super().after_forward(out, seconds)

    def after_sample(self, seqs: list[Sequence]) -> None:
        self.calls.append(f"after_sample {len(seqs)}")

    def finished(self, seq: Sequence) -> None:
        self.calls.append(f"finished {seq.request_id}")

    def dropped(self, seq: Sequence) -> None:
        self.calls.append(f"dropped {seq.request_id}")
        super().dropped(seq)


def null_core(loaded: LoadedModel) -> EngineCore:
    core = EngineCore(make_core(loaded).config, loaded)
    assert isinstance(core.offload, NullOffload)  # the core's own without an offload factory
    return core


def test_a_step_calls_the_boundary_at_its_named_points_in_order(loaded: LoadedModel) -> None:
    rec = Recording()
    core = EngineCore(make_core(loaded).config, loaded, offload=lambda *parts: rec)
    try:
        add(core, loaded, "a", None)
        core.step()  # the whole prompt fits one step: prefill and the first token
        assert rec.calls == ["begin_step", "forward", "forward done", "after_forward",
                             "after_sample 1"]
        rec.calls.clear()
        run(core)
        assert rec.calls[-2:] == ["finished a", "after_sample 0"]
        add(core, loaded, "b", None)
        assert core.abort("b") is not None
        assert rec.calls[-1] == "dropped b"
    finally:
        core.close()


def test_null_offload_drops_a_plan_and_recomputes_to_the_same_tokens(
    loaded: LoadedModel,
) -> None:
    core = null_core(loaded)
    try:
        add(core, loaded, "plain", None)
        want = run(core)["plain"]
        core.drop_cached()
        add(core, loaded, "planned", two_block_plan("lease-1"))  # nobody could load it
        seq = core._live["planned"].seq
        assert seq.offload.plan is None
        assert run(core)["planned"] == want
        assert core.offload.held_blocks() == [] and not core.offload.holds_blocks
    finally:
        core.close()


def test_null_offload_reports_device_hits_and_recomputed_tokens(loaded: LoadedModel) -> None:
    core = null_core(loaded)
    try:
        add(core, loaded, "a", None)
        run(core)
        first = core.status().reuse
        assert first.device_tokens == 0 and first.recomputed_tokens > 0
        add(core, loaded, "b", None)  # the same prompt: its full blocks are on device
        run(core)
        second = core.status().reuse
        assert second.device_tokens > 0
        assert second.loaded_tokens == {} and second.load_failures == 0
        # the same prompt twice: each of its tokens was either found on device or computed
        assert second.device_tokens + (second.recomputed_tokens - first.recomputed_tokens) \
            == first.recomputed_tokens
    finally:
        core.close()

