"""load_model: a local Hugging Face model folder -> a ready LlamaModel and Tokenizer."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.libc import trim_heap

from .errors import LoaderError
from .fingerprint import model_fingerprint
from .hf_config import ModelConfig, eos_ids_from_generation_config
from .llama import DecoderLayer, LlamaModel
from .safetensors_files import SafetensorsFile, read_header, weight_files
from .tokenizer import Tokenizer
from .weights import TensorSource, build_weights

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer
    fingerprint: str  # hex sha256, see fingerprint.py
    name: str  # served name
    path: Path
    dtype: torch.dtype


def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise LoaderError(f"{path}: file is missing")
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoaderError(f"{path}: malformed JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise LoaderError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_config(folder: Path) -> tuple[ModelConfig, dict[str, Any]]:
    """ModelConfig plus the raw config.json (for the fingerprint)."""
    raw = _read_json(folder / "config.json", required=True)
    assert raw is not None
    gen = _read_json(folder / "generation_config.json", required=False) or {}
    try:
        cfg = ModelConfig.from_dict(raw, extra_eos=eos_ids_from_generation_config(gen))
    except LoaderError as exc:
        where = f"{folder / 'config.json'}:"
        raise LoaderError(str(exc).replace("config.json:", where, 1)) from exc
    return cfg, raw


def own_memory(model: torch.nn.Module, files: list[SafetensorsFile]) -> None:
    """Where most of a file was packed or quantized into copies at load (float32, int4,
    int8 weights), copy the few weights still viewing its mapping (norms, a float table)
    into anonymous memory and drop the mapping: every page read through it at load stays
    resident while it lives, on top of the copies (a float32 SmolLM2 held its 540 MB
    twice). A file whose weights are served in place (bf16 on a bf16 model) stays mapped:
    there the mapping is the weights, not a second copy of them."""
    tensors = [*model.parameters(), *model.buffers()]
    for f in files:
        views = [t for t in tensors if f.maps(t)]
        if sum(t.numel() * t.element_size() for t in views) * 2 > f.size:
            continue
        for t in views:
            t.data = _copy_out(t.data, f)
        f.unmap()


_COPY_SLICE = 4 << 20  # elements copied between two drops of the file's pages


def _copy_out(t: torch.Tensor, f: SafetensorsFile) -> torch.Tensor:
    """``t`` (a view of ``f``'s mapping) copied into anonymous memory a slice at a time,
    the file's pages dropped after each: a float32 tied embedding (113 MB for SmolLM2)
    never sits in RSS twice."""
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    if not t.is_contiguous():
        return out.copy_(t)
    for dst, src in zip(out.view(-1).split(_COPY_SLICE), t.view(-1).split(_COPY_SLICE),
                        strict=True):
        dst.copy_(src)
        f.drop_pages()
    return out


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    served_name: str = "",
    quant: str = "",
) -> LoadedModel:
    """``dtype`` is the activations' and KV's; ``quant`` ("q4", "q8_0") quantizes float
    weights at load (weights stored quantized stay so whatever it says)."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoaderError(f"{folder}: model folder does not exist")
    if not dtype.is_floating_point:
        raise LoaderError(f"dtype {dtype} is not a floating-point type")
    start = time.perf_counter()
    cfg, raw = read_config(folder)
    tokenizer = Tokenizer.from_folder(folder, cfg.eos_token_ids)
    files = [read_header(p) for p in weight_files(folder)]
    dev = torch.device(device)
    glob, layers = build_weights(cfg, TensorSource(files, dtype, dev, quant))

    def drop_file_pages(layer: DecoderLayer) -> None:
        # Each layer is packed or quantized into copies as it is built: the file pages it
        # read leave RSS now, not when the mapping goes (the load's peak was the whole
        # file's pages beside all the copies: 1.37 GiB for a 540 MB float32 SmolLM2). A
        # file the layer computes on in place (bf16 served as stored) keeps its pages.
        weights = [lin.w for lin in layer.linears() if lin.w is not None]
        for f in files:
            if not any(f.maps(w) for w in weights):
                f.drop_pages()

    model = LlamaModel(cfg, glob, layers, after_layer=drop_file_pages).eval()
    del glob, layers  # the plain weights that packing replaced (see linear.py) go now
    own_memory(model, files)
    trim_heap()  # and glibc hands their memory back instead of keeping it for reuse
    # (a load-time quantization changes the weights: it is part of the model's identity)
    fp = model_fingerprint(raw, folder / "tokenizer.json", files, dtype, quant)
    name = served_name or folder.resolve().name
    log.info(
        "loaded %s (%s, %d layers, %s) in %.2fs, fingerprint %s",
        name,
        cfg.architecture,
        cfg.num_layers,
        dtype,
        time.perf_counter() - start,
        fp[:12],
    )
    return LoadedModel(cfg, model, tokenizer, fp, name, folder, dtype)
