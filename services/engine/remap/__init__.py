"""MIRAGE's parameter remapping in the engine: the Remapping Controller (Algorithm 1),
the layer choice (§5.4, Equations 3-5) and the transfer engine that streams remapped
layers into their slots ahead of compute."""

from __future__ import annotations

from .controller import ControllerState, KvLender, RemappingController, RemapTarget
from .layer_choice import (
    LayerPlan,
    choose_slots,
    double_buffer_fits,
    max_alpha,
    plan_layers,
    single_slot_fits,
    uniform_layers,
)
from .runtime import PoolLender, Remapper, lendable_bytes, remappable
from .streamer import LayerStreamer, host_tensors, layer_bytes
from .transfer import SlotCopier, ThreadCopier, make_copier

__all__ = [
    "ControllerState",
    "KvLender",
    "LayerPlan",
    "LayerStreamer",
    "PoolLender",
    "RemapTarget",
    "Remapper",
    "RemappingController",
    "SlotCopier",
    "ThreadCopier",
    "choose_slots",
    "double_buffer_fits",
    "host_tensors",
    "layer_bytes",
    "lendable_bytes",
    "make_copier",
    "max_alpha",
    "plan_layers",
    "remappable",
    "single_slot_fits",
    "uniform_layers",
]
