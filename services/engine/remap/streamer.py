"""The forward's side of remapping: streamed layers are computed in slots, each copied
from the layer's host copy one slot-turn ahead of its compute (MIRAGE §4.1, §5.4).

    plan: layers (0, 4) of 8, one slot            release(L) -> copy the layer `slots`
    step:  acquire(0) [slot: 0]  1 2 3              places after L, around the circle,
           release(0) -> copy 4 into the slot       into the slot L just left
           acquire(4) waits for that copy, ...
           release(4) -> copy 0 (the next step's)

``acquire`` returns the module to compute layer i with: the resident layer, or the slot
holding it once its copy is done. A copy not done by then stalls the compute (counted).
A slot found holding another layer (a forward that stopped half way, a plan just
installed) is filled at once, in order: never a wrong layer's weights.

The host copy of a layer is its plain weights: views into the node's weight arena for a
model mapped from the Reuse Store (``model/mapped.py``), else the layer's own tensors (a
oneDNN-packed weight unpacked once, when the layer is first streamed). On CPU the device
and host are the same memory: the bytes a remapped layer lends are the budget's (the KV
pool's page limit and the node's ledger), and the copy into its slot is the real one. On
a GPU (written, untested) a streamed layer's weights move to pinned host memory and leave
the device until it is resident again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.linear import Linear
from ..model.llama import DecoderLayer, LlamaModel
from .layer_choice import LayerPlan
from .transfer import SlotCopier, Transfer

LINEARS = ("qkv", "o", "gate_up", "down")
NAMES = ("input_norm", "post_norm", *(f"{n}_{p}" for n in LINEARS for p in ("w", "b")))


def host_tensors(layer: DecoderLayer) -> dict[str, torch.Tensor]:
    """A layer's weights as plain tensors, by ``DecoderLayer`` weight name (biases only
    where the layer has them)."""
    out = {"input_norm": layer.input_norm.detach(), "post_norm": layer.post_norm.detach()}
    for name in LINEARS:
        lin = getattr(layer, name)
        if not isinstance(lin, Linear):
            raise ValueError("a quantized layer cannot be remapped")
        out[name + "_w"] = lin.weight.detach()
        if lin.b is not None:
            out[name + "_b"] = lin.b.detach()
    return out


def layer_bytes(layer: DecoderLayer) -> int:
    """Bytes of one layer's weights (what remapping it lends)."""
    return sum(t.numel() * t.element_size() for t in host_tensors(layer).values())


def _evict(layer: DecoderLayer) -> dict[str, torch.Tensor]:  # pragma: no cover - GPU
    """On a GPU (written, untested): the layer's weights move to pinned host memory, the
    copy its slot is filled from, and leave the device: the bytes the KV is lent."""
    host = {k: t.to("cpu").pin_memory() for k, t in host_tensors(layer).items()}
    for name in host:
        p = getattr(layer, name)
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # (Linear views the Parameter)
    return host


def _restore(layer: DecoderLayer, host: dict[str, torch.Tensor]) -> None:  # pragma: no cover
    """Reversion on a GPU: the layer's weights back on the device from its host copy."""
    for name, t in host.items():
        p = getattr(layer, name)
        p.data = t.to(p.device)


@dataclass
class _Slot:
    layer: DecoderLayer
    buffers: dict[str, torch.Tensor]
    holds: int | None = None
    pending: tuple[int, Transfer] | None = None


@dataclass
class StreamStats:
    """Since the engine started; ``step_*`` for the last forward."""

    transfers: int = 0
    transfer_s: float = 0.0
    stalled_forwards: int = 0
    step_transfer_s: float = 0.0
    step_stalled: bool = False
    bytes_streamed: int = 0
    per_layer_s: list[float] = field(default_factory=list)  # recent copy times


class LayerStreamer:
    def __init__(self, model: LlamaModel, copier: SlotCopier) -> None:
        self._model = model
        self._copier = copier
        self.plan = LayerPlan(0, 0, ())
        self._slots: list[_Slot] = []
        self._host: dict[int, dict[str, torch.Tensor]] = {}
        self._position: dict[int, int] = {}
        self.stats = StreamStats()

    # ---- between steps ------------------------------------------------------------------
    def install(self, plan: LayerPlan) -> None:
        """Stream ``plan``'s layers from the next forward on (alpha 0: none, every layer
        resident, slots freed). Waits for copies under way first."""
        self._drain()
        self.plan = plan
        self._position = {layer: j for j, layer in enumerate(plan.layers)}
        layers = self._model.decoder_layers
        on_gpu = self._model.device.type == "cuda"
        for i in [i for i in self._host if i not in self._position]:
            host = self._host.pop(i)
            if on_gpu:  # pragma: no cover - needs a GPU (untested)
                _restore(layers[i], host)
        if not plan.layers:
            self._slots = []
            self._model.streamer = None
            return
        for i in plan.layers:
            if i not in self._host:
                self._host[i] = _evict(layers[i]) if on_gpu else host_tensors(layers[i])
        first = plan.layers[0]
        while len(self._slots) > plan.slots:
            self._slots.pop()
        while len(self._slots) < plan.slots:
            self._slots.append(self._new_slot(layers[first], self._host[first]))
        for j, slot in enumerate(self._slots):
            slot.holds = None
            self._submit(slot, plan.layers[j])
        self._model.streamer = self

    def _new_slot(self, template: DecoderLayer, host: dict[str, torch.Tensor]) -> _Slot:
        """A layer over buffers shaped like ``host`` (every layer's: uniform layers),
        computing each linear with ``template``'s kernel."""
        device = self._model.device
        buffers = {k: torch.empty_like(t, device=device) for k, t in host.items()}
        w = {k: buffers.get(k) for k in NAMES}
        layer = DecoderLayer(self._model.config, w, template.upcast_rows)
        for name in LINEARS:  # the resident layer's kernel for each linear
            setattr(layer, name, getattr(template, name).like(buffers[name + "_w"],
                                                              buffers.get(name + "_b")))
        return _Slot(layer, buffers)

    def begin_step(self) -> None:
        self.stats.step_transfer_s = 0.0
        self.stats.step_stalled = False

    @property
    def slot_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self._slots for t in s.buffers.values())

    # ---- the forward --------------------------------------------------------------------
    def acquire(self, i: int) -> DecoderLayer:
        if i not in self._position:
            return self._model.decoder_layers[i]
        for slot in self._slots:
            if slot.pending is not None and slot.pending[0] == i:
                self._finish(slot)
                return slot.layer
            if slot.holds == i and slot.pending is None:
                return slot.layer
        # Out of turn (a forward that stopped half way): fill the slot this layer's
        # predecessor in the turn order uses, now.
        slot = self._slots[self._position[i] % len(self._slots)]
        if slot.pending is not None:
            self._finish(slot)
        self._submit(slot, i)
        self._finish(slot)
        return slot.layer

    def release(self, i: int) -> None:
        j = self._position.get(i)
        if j is None:
            return
        for slot in self._slots:
            if slot.holds == i and slot.pending is None:
                layers = self.plan.layers
                self._submit(slot, layers[(j + len(self._slots)) % len(layers)])
                return

    # ---- internals ----------------------------------------------------------------------
    def _submit(self, slot: _Slot, layer: int) -> None:
        host = self._host[layer]
        keys = list(host)
        slot.holds = None
        slot.pending = (layer, self._copier.submit([slot.buffers[k] for k in keys],
                                                   [host[k] for k in keys]))

    def _finish(self, slot: _Slot) -> None:
        assert slot.pending is not None
        layer, transfer = slot.pending
        if not transfer.done():
            self.stats.step_stalled = True
        transfer.wait()
        slot.pending, slot.holds = None, layer
        slot.layer.upcast_rows = self._model.upcast_rows  # (set_upcast_rows may have moved it)
        for name in LINEARS:  # float32 copies of a half-precision weight were the last layer's
            lin = getattr(slot.layer, name)
            if isinstance(lin, Linear):
                lin.release_float32()
        s = self.stats
        s.transfers += 1
        s.transfer_s += transfer.seconds
        s.step_transfer_s += transfer.seconds
        s.bytes_streamed += sum(t.numel() * t.element_size() for t in self._host[layer].values())
        s.per_layer_s = [*s.per_layer_s[-15:], transfer.seconds]

    def _drain(self) -> None:
        for slot in self._slots:
            if slot.pending is not None:
                self._finish(slot)

    def end_forward(self) -> None:
        """After a forward: count it stalled if any copy made the compute wait."""
        if self.stats.step_stalled:
            self.stats.stalled_forwards += 1

    def close(self) -> None:
        self._drain()
        self._copier.close()
