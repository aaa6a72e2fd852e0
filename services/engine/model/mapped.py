"""Load a model whose weights are views into the node's weight arena (the nodemgr's Reuse
Store, Tangram §3.1): tensors already resident are mapped as they are, the others are
written into their regions from the model folder first; the model then computes on the
views directly, with no private copy (nothing packed into oneDNN's layout or cloned:
either would be a copy of its own).

    arena file (shared, every engine of the node maps it)
    | ... | layers.0.qkv_w | ... | embed | ... |        one region per distinct tensor
            ^ view (dtype, shape) at its offset: the engine's parameter
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.weight_layout import DTYPE_BYTES, engine_tensors

from ..device import map_weight_arena
from .errors import LoaderError
from .fingerprint import model_fingerprint
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
                served_name: str = "") -> MappedLoad:
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
    filled, fill_s = 0, 0.0
    for t in stored.tensors:
        spec = layout.get(t.name)
        if spec is None or spec.nbytes(stored.dtype) != t.nbytes \
                or t.offset % DTYPE_BYTES[stored.dtype] or t.offset + t.nbytes > stored.arena_bytes:
            raise LoaderError(f"the weight arena's plan for {t.name!r} does not match "
                              f"{folder}'s checkpoint")
        view = arena[t.offset:t.offset + t.nbytes].view(dtype).view(spec.shape)
        if t.fill:
            started = time.perf_counter()
            _fill(view, [src.where[p].tensor(p) for p in spec.parts])
            fill_s += time.perf_counter() - started
            filled += t.nbytes
        views[t.name] = view
    missing = set(layout) - set(views)
    if missing:
        raise LoaderError(f"the weight arena's plan lacks {sorted(missing)[:3]}")
    glob = {"embed": views["embed"], "norm": views["norm"], "lm_head": views.get("lm_head")}
    keys = ("input_norm", "post_norm", "qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w",
            "gate_up_b", "down_w", "down_b")
    layers = [{k: views.get(f"layers.{i}.{k}") for k in keys} for i in range(cfg.num_layers)]
    model = LlamaModel(cfg, glob, layers, own_weights=False).eval()
    fp = model_fingerprint(raw, folder / "tokenizer.json", files, dtype)
    name = served_name or folder.resolve().name
    return MappedLoad(LoadedModel(cfg, model, tokenizer, fp, name, folder, dtype), filled,
                      fill_s)
