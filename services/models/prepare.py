"""Turn a GGUF file into a folder the engine serves: safetensors weights in the serving
dtype, ``config.json`` with its architecture, the tokenizer, its chat template and the
generation config (for the end-of-turn tokens).

    GGUF ──gguf (check the file)──► transformers' GGUF loader (dequantize) ──► a temp folder
         ──► the engine loads it and answers a question ──► renamed into place + marker

With a quantized dtype (``q4``, ``q8_0``) only the metadata goes through transformers
(config and tokenizer); the weights keep their GGUF codes (gguf_weights.py).

Idempotent: the folder carries ``overture-prepared.json`` naming the source (path, size,
modification time) and dtype; preparing again with the same ones does nothing. Families:
Llama (SmolLM2, Llama 2/3, TinyLlama...), Mistral and Qwen2, as the engine serves them.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

MARKER = "overture-prepared.json"
FAMILIES = ("llama", "mistral", "qwen2")
DTYPES = ("float32", "bfloat16", "float16", "q8_0", "q4")
QUANTIZED = ("q8_0", "q4")  # weights int8 / int4 (services/engine/model/quant/)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM"}


class ModelPrepareError(Exception):
    """The file cannot become a served model (unreadable, truncated, unsupported)."""


def source_id(gguf: Path, dtype: str) -> dict[str, object]:
    st = gguf.stat()
    return {"source": str(gguf.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "dtype": dtype, "version": 1}


def is_prepared(gguf: Path, out: Path, dtype: str) -> bool:
    try:
        return bool(json.loads((out / MARKER).read_text()) == source_id(gguf, dtype))
    except (OSError, ValueError):
        return False


def gguf_family(gguf: Path) -> str:
    """The model family a GGUF file declares; ``ModelPrepareError`` if it is not a
    readable GGUF file or not a family the engine serves."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(gguf))
        field = reader.fields.get("general.architecture")
        if field is None:
            raise ModelPrepareError(f"{gguf}: no general.architecture in the GGUF metadata")
        family = bytes(field.parts[field.data[0]]).decode()
    except ModelPrepareError:
        raise
    except Exception as e:  # the reader raises whatever its parse hits on a bad file
        raise ModelPrepareError(
            f"{gguf}: not a readable GGUF file ({type(e).__name__}: {e}); is it truncated "
            "or corrupt? Download or copy it again") from None
    if family not in FAMILIES:
        raise ModelPrepareError(f"{gguf}: a {family!r} model; Overture serves "
                                f"{', '.join(FAMILIES)}")
    return family


def prepare_gguf(gguf: Path, out: Path, dtype: str = "float32",
                 say: Callable[[str], None] = print) -> Path:
    """``out``, a served folder made from ``gguf`` (nothing to do if already made)."""
    if dtype not in DTYPES:
        raise ModelPrepareError(f"dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if not gguf.is_file():
        raise ModelPrepareError(f"{gguf}: no such file")
    if is_prepared(gguf, out, dtype):
        return out
    family = gguf_family(gguf)
    t0 = time.monotonic()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    steps = _Steps(say, 3)
    say(f"preparing {gguf.name} for serving: once, about half a minute on a 2-core CPU")
    try:
        if dtype in QUANTIZED:
            steps.next(f"reading {gguf.name} ({family}, {gguf.stat().st_size >> 20} MiB), "
                       f"its quantized weights kept as they are ({dtype})")
            _convert_quantized(gguf, tmp, dtype, family)
        else:
            steps.next(f"dequantizing {gguf.name} ({family}, {gguf.stat().st_size >> 20} "
                       f"MiB) to {dtype} with transformers' GGUF loader")
            _convert(gguf, tmp, dtype)
        steps.next("checking that the engine loads it and answers")
        answer = _check(tmp, dtype)
        steps.next(f"done; it answered {answer!r}")
        (tmp / MARKER).write_text(json.dumps(source_id(gguf, dtype)))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"prepared {out} in {time.monotonic() - t0:.0f} s")
    return out


class _Steps:
    """A one-line-per-step progress display: ``[2/3] what (12 s so far)``."""

    def __init__(self, say: Callable[[str], None], total: int) -> None:
        self.say, self.total, self.n, self.t0 = say, total, 0, time.monotonic()

    def next(self, what: str) -> None:
        self.n += 1
        self.say(f"[{self.n}/{self.total}] {what} ({time.monotonic() - self.t0:.0f} s so far)")


def _convert(gguf: Path, out: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its notes on GGUF conversion are not for our users
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype))
    except Exception as e:
        raise ModelPrepareError(f"{gguf}: the GGUF loader failed: {type(e).__name__}: "
                                f"{e}") from None
    out.mkdir(parents=True)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as the embedding
    save_file({k: v.detach().contiguous() for k, v in state.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    tok.save_pretrained(str(out))


def _convert_quantized(gguf: Path, out: Path, dtype: str, family: str) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    from .gguf_weights import quantized_state

    hf_logging.set_verbosity_error()
    try:  # metadata only: neither reads a weight
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        state = quantized_state(gguf, family, config.to_dict(), dtype)
    except Exception as e:
        raise ModelPrepareError(f"{gguf}: reading it failed: {type(e).__name__}: {e}") from None
    # A file without an output tensor ties its head to the embedding.
    config.tie_word_embeddings = not any(k.startswith("lm_head.") for k in state)
    config.architectures = [ARCHITECTURES[family]]
    out.mkdir(parents=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    tok.save_pretrained(str(out))


def _check(folder: Path, dtype: str) -> str:
    """The engine's greedy answer to a short question, from ``folder``."""
    # The engine (torch) only when a prepared model is checked: `overture models` stays quick.
    from services.engine.api_types import ChatMessage, GenerateRequest, SamplingParams
    from services.engine.async_engine import AsyncEngine
    from services.engine.config import EngineConfig

    async def ask() -> str:
        cfg = EngineConfig(model_path=str(folder), dtype=dtype, device_memory_bytes=64 << 20)
        req = GenerateRequest(messages=(ChatMessage("user", "Say hello."),),
                              sampling=SamplingParams(max_tokens=8, temperature=0.0))
        async with AsyncEngine(cfg) as eng:
            return "".join([out.text async for out in eng.generate(req)])

    try:
        answer = asyncio.run(ask())
    except Exception as e:
        raise ModelPrepareError(f"the prepared model does not serve: {type(e).__name__}: "
                                f"{e}") from None
    if not answer.strip():
        raise ModelPrepareError("the prepared model answered nothing")
    return answer.strip()


def slug(name: str) -> str:
    """A folder name for a model file (``SmolLM2-135M.Q4_1.gguf`` → ``smollm2-135m-q4_1``)."""
    stem = name.removesuffix(".gguf").lower()
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in stem).strip("-") or "model"


def stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
