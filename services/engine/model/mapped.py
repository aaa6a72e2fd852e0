"""Load a model whose weights are views into the node's weight arena (the nodemgr's Reuse
Store, Tangram §3.1): tensors already resident are mapped as they are, the others are
written into their regions from the model folder first; the model then computes on the
views directly, with no private copy (nothing cloned). A float32 weight oneDNN computes is
held in the arena in oneDNN's layout (``arena_layout.py``), so that it computes as a
privately loaded (packed) one: as fast, and with the same bits.

    arena file (shared, every engine of the node maps it)
    | ... | layers.0.qkv_w | ... | embed | ... |        one region per distinct tensor
            ^ view (dtype, shape) at its offset: the engine's parameter, or a oneDNN
              tensor over the region's packed bytes (a linear's weight)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.weight_layout import DTYPE_BYTES, engine_tensors

from ..device import map_weight_arena
from .arena_layout import ArenaLayouts
from .errors import LoaderError
from .fingerprint import model_fingerprint
from .linear import Linear
from .llama import LlamaModel
from .loader import LoadedModel, read_config
from .safetensors_files import read_header, weight_files
from .tokenizer import Tokenizer
from .weights import TensorSource


@dataclass(frozen=True)
class StoredTensor:
    name: str
    offset: int
    nbytes: int
    fill: bool


@dataclass(frozen=True)
class StoredWeights:
    """Where the nodemgr put the model's tensors in the arena."""

    arena: str
    arena_bytes: int
    dtype: str
    tensors: tuple[StoredTensor, ...]


@dataclass(frozen=True)
class MappedLoad:
    loaded: LoadedModel
    filled_bytes: int
    fill_seconds: float


def _fill(view: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """Write the checkpoint's ``parts`` (views of its file, in their own dtype) into the
    arena ``view``, one after the other along dim 0, converting on the way: one pass over
    the bytes, where converting first and concatenating after would make two copies.

        view (rows, ...):  | part 0 rows | part 1 rows | part 2 rows |
    """
    at = 0
    with torch.no_grad():
        for part in parts:
            if not view.dim():  # (a scalar tensor: one part)
                view.copy_(part)
                return
            rows = part.shape[0]
            view[at:at + rows].copy_(part)
            at += rows


def load_mapped(path: str | Path, stored: StoredWeights, dtype: torch.dtype,
                served_name: str = "", layouts: ArenaLayouts | None = None) -> MappedLoad:
    """``layouts``: the engine's (found once per weight shape; None: a new one)."""
    layouts = layouts if layouts is not None else ArenaLayouts()
    folder = Path(path)
    name_of = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    if name_of.get(dtype) != stored.dtype:
        raise LoaderError(f"the node's weight arena holds {stored.dtype} tensors, this engine "
                          f"serves {dtype}: set the nodemgr's weights_dtype to the engine's")
    cfg, raw = read_config(folder)
    tokenizer = Tokenizer.from_folder(folder, cfg.eos_token_ids)
    files = [read_header(p) for p in weight_files(folder)]
    src = TensorSource(files, dtype, torch.device("cpu"))
    shapes = {n: f.tensors[n].shape for f in files for n in f.tensors}
    layout = {t.name: t for t in engine_tensors(shapes, cfg.num_layers,
                                                cfg.tie_word_embeddings)}
    arena = map_weight_arena(stored.arena, stored.arena_bytes)  # (the device seam)
    views: dict[str, torch.Tensor] = {}
    in_arena: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # packed: (weight, region)
    filled, fill_s = 0, 0.0
    scratch = torch.empty(0, dtype=dtype)  # (one plain buffer for every packed weight)
    for t in stored.tensors:
        spec = layout.get(t.name)
        if spec is None or spec.nbytes(stored.dtype) != t.nbytes \
                or t.offset % DTYPE_BYTES[stored.dtype] or t.offset + t.nbytes > stored.arena_bytes:
            raise LoaderError(f"the weight arena's plan for {t.name!r} does not match "
                              f"{folder}'s checkpoint")
        region = arena[t.offset:t.offset + t.nbytes]
        pack = layouts.applies(t.name, spec.shape, dtype, bias=t.name.endswith("_w")
                               and t.name[:-2] + "_b" in layout)
        if t.fill:
            started = time.perf_counter()
            # (a weight held packed is made plain first, then packed into its region: in
            # one buffer reused, whose pages fault in once, not once a weight)
            numel = math.prod(spec.shape)
            if pack and scratch.numel() < numel:
                scratch = torch.empty(numel, dtype=dtype)
            dst = scratch[:numel].view(spec.shape) if pack else \
                region.view(dtype).view(spec.shape)
            _fill(dst, [src.where[p].tensor(p) for p in spec.parts])
            if pack:
                layouts.fill(region, dst)
            fill_s += time.perf_counter() - started
            filled += t.nbytes
        if pack:
            in_arena[t.name] = (layouts.view(region, (spec.shape[0], spec.shape[1])), region)
        else:
            views[t.name] = region.view(dtype).view(spec.shape)
    missing = set(layout) - set(views) - set(in_arena)
    if missing:
        raise LoaderError(f"the weight arena's plan lacks {sorted(missing)[:3]}")

    def weight(name: str, bias: str | None) -> Linear | torch.Tensor | None:
        if name not in in_arena:
            return views.get(name)
        packed, region = in_arena[name]
        return Linear.over_arena(packed, views.get(bias) if bias else None, region)

    glob = {"embed": views["embed"], "norm": views["norm"], "lm_head": weight("lm_head", None)}
    layers = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        layer: dict[str, Linear | torch.Tensor | None] = {
            k: views.get(p + k) for k in ("input_norm", "post_norm")}
        for lin in ("qkv", "o", "gate_up", "down"):
            w = weight(p + lin + "_w", p + lin + "_b")
            layer[lin + "_w"] = w  # (a ready Linear carries its bias)
            layer[lin + "_b"] = None if isinstance(w, Linear) else views.get(p + lin + "_b")
        layers.append(layer)
    model = LlamaModel(cfg, glob, layers, own_weights=False).eval()
    fp = model_fingerprint(raw, folder / "tokenizer.json", files, dtype)
    name = served_name or folder.resolve().name
    return MappedLoad(LoadedModel(cfg, model, tokenizer, fp, name, folder, dtype), filled,
                      fill_s)
