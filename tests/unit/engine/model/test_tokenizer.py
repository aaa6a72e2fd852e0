"""Tokenizer: prompts, chat template rendering, streaming detokenization."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from services.engine.model import IncrementalDetokenizer, LoaderError, Tokenizer

MULTIBYTE = "Café déjà vu — 你好，世界！ 😀🚀 naïve Größe ✨ done."


@pytest.fixture(scope="module")
def tok(demo_tiny: Path) -> Tokenizer:
    return Tokenizer.from_folder(demo_tiny)


def test_encode_prompt_adds_bos_once(tok: Tokenizer) -> None:
    ids = tok.encode_prompt("Hello world")
    assert ids[0] == tok.bos_token_id == 0
    assert ids.count(0) == 1
    assert tok.decode(ids) == "Hello world"
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>Hello world"


def test_add_bos_token_setting_is_honoured(demo_tiny: Path, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(demo_tiny, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = False
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_folder(folder).encode_prompt("Hello")[0] != 0


def test_chat_template_renders_llama3_layout(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "  Hi there!  "}]
    text = tok.render_chat(messages)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief."
                    "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi there!<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert not tok.render_chat(messages, add_generation_prompt=False).endswith("\n\n")
    ids = tok.encode_chat(messages)
    assert ids[0] == 0 and ids.count(0) == 1  # bos from the template only, not added again
    assert ids.count(4) == 2  # <|eot_id|> is one special token each time
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_chat_template_errors_are_value_errors(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="unknown role robot"):
        tok.encode_chat([{"role": "robot", "content": "beep"}])
    with pytest.raises(ValueError, match="content must be a string"):
        tok.encode_chat([{"role": "user", "content": 3}])
    with pytest.raises(ValueError, match="no 'role'"):
        tok.encode_chat([{"content": "hi"}])


def test_no_chat_template_and_broken_template(demo_tiny: Path, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(demo_tiny, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    plain = Tokenizer.from_folder(folder)
    with pytest.raises(ValueError, match="no chat template"):
        plain.encode_chat([{"role": "user", "content": "hi"}])
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoaderError, match="does not compile"):
        Tokenizer.from_folder(folder)


def test_template_is_sandboxed(demo_tiny: Path, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(demo_tiny, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError):
        Tokenizer.from_folder(folder).encode_chat([{"role": "user", "content": "x"}])


def test_multibyte_roundtrip(tok: Tokenizer) -> None:
    ids = tok.encode_prompt(MULTIBYTE)
    assert tok.decode(ids) == MULTIBYTE


@pytest.mark.parametrize("step", [1, 2, 3])
def test_incremental_detokenizer_never_splits_characters(tok: Tokenizer, step: int) -> None:
    prompt = tok.encode_chat([{"role": "user", "content": "Say something."}])
    generated = tok.encode_prompt(MULTIBYTE)[1:]  # byte-level pieces split CJK and emoji
    # The tokenizer really does split some characters across tokens here.
    assert any("\ufffd" in tok.decode([t]) for t in generated)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(generated[i:i + step]) for i in range(0, len(generated), step)]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(generated) == MULTIBYTE


def test_incremental_detokenizer_flushes_a_dangling_byte(tok: Tokenizer) -> None:
    emoji = tok.encode_prompt("😀")[1:]
    assert len(emoji) > 1
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(emoji[:-1]) == ""  # incomplete character held back
    assert detok.flush() == tok.decode(emoji[:-1])


def test_vocab_and_eos(tok: Tokenizer) -> None:
    assert tok.vocab_size == 1024
    assert 4 in tok.eos_token_ids  # <|eot_id|> from tokenizer_config
