"""What ``overture models`` and ``up --model`` accept, without converting anything (the
conversion itself is tested on the real model in tests/integration/models)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli import main
from services.models.catalog import DEFAULT_MODEL, ModelNotFound, available, locate
from services.models.commands import model_folder
from services.models.prepare import (
    MARKER,
    ModelPrepareError,
    is_prepared,
    prepare_gguf,
    slug,
    source_id,
)


def test_the_default_model_comes_from_its_installed_package() -> None:
    gguf = locate(DEFAULT_MODEL)
    assert gguf.name.endswith(".gguf") and gguf.stat().st_size > 50 << 20
    with pytest.raises(ModelNotFound, match="smollm2-135m-instruct"):
        locate("gpt-5")


def test_folder_names_for_model_files() -> None:
    assert slug("SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct-q4_1"
    assert slug("a b/c.gguf") == "a-b-c"
    assert slug(".gguf") == "model"


def test_what_a_model_may_be(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert model_folder(str(folder), "float32", tmp_path / "models") == folder
    with pytest.raises(ModelNotFound, match="no such file"):
        model_folder(str(tmp_path / "missing.gguf"), "float32", tmp_path / "models")
    with pytest.raises(ModelNotFound, match="not a packaged model"):
        model_folder(str(tmp_path / "nothing-here"), "float32", tmp_path / "models")
    with pytest.raises(ModelPrepareError, match="dtype"):
        prepare_gguf(locate(DEFAULT_MODEL), tmp_path / "x", "int8")


def test_a_folder_is_prepared_only_for_its_source_and_dtype(tmp_path: Path) -> None:
    gguf = locate(DEFAULT_MODEL)
    out = tmp_path / "m"
    out.mkdir()
    assert not is_prepared(gguf, out, "float32")
    (out / MARKER).write_text(json.dumps(source_id(gguf, "float32")))
    assert is_prepared(gguf, out, "float32") and not is_prepared(gguf, out, "bfloat16")
    (out / "config.json").write_text("{}")
    names = [a.name for a in available(tmp_path)]
    assert names == [DEFAULT_MODEL, "m"]


def test_models_list_and_bad_prepare(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["models", "list"]) == 0
    assert "smollm2-135m-instruct  (default)" in capsys.readouterr().out
    assert main(["models", "prepare", str(tmp_path / "nope.txt")]) == 2
    assert "give a packaged model" in capsys.readouterr().err
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(64))
    assert main(["models", "prepare", str(junk), "--out", str(tmp_path / "o")]) == 2
    assert "not a readable GGUF file" in capsys.readouterr().err
