"""Tokenizer from a model folder (tokenizer.json + tokenizer_config.json) and streaming text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from .chat_template import ChatTemplate, ChatTemplateError
from .errors import LoaderError


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_source(folder: Path, cfg: dict[str, Any]) -> str | None:
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    if isinstance(tpl, str):
        return tpl
    jinja_file = folder / "chat_template.jinja"
    return jinja_file.read_text() if jinja_file.is_file() else None


class Tokenizer:
    def __init__(
        self,
        tok: HFTokenizer,
        config: dict[str, Any],
        template: str | None,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self._tok = tok
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = tok.token_to_id(self.bos_token) if self.bos_token else None
        eos = list(eos_token_ids)
        own_eos = tok.token_to_id(self.eos_token) if self.eos_token else None
        if own_eos is not None and own_eos not in eos:
            eos.append(own_eos)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        # None: let tokenizer.json's post-processor decide, as transformers does.
        add_bos = config.get("add_bos_token")
        self.add_bos: bool | None = None if add_bos is None else bool(add_bos)
        self.template_source = template
        self._template = (
            ChatTemplate(template, self.bos_token or "", self.eos_token or "") if template else None
        )

    @classmethod
    def from_folder(cls, folder: Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise LoaderError(f"{path}: tokenizer.json is missing")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception on parse errors
            raise LoaderError(f"{path}: cannot parse tokenizer: {exc}") from exc
        cfg_path = folder / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if cfg_path.is_file():
            try:
                config = json.loads(cfg_path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise LoaderError(f"{cfg_path}: malformed JSON: {exc}") from exc
            if not isinstance(config, dict):
                raise LoaderError(f"{cfg_path}: expected a JSON object")
        try:
            tokenizer = cls(tok, config, _template_source(folder, config), eos_token_ids)
        except ChatTemplateError as exc:
            raise LoaderError(f"{cfg_path}: {exc}") from exc
        return tokenizer

    def to_json(self) -> str:
        """tokenizer.json as text (the grammar library builds its token trie from it)."""
        return self._tok.to_str()

    def token_id(self, text: str) -> int | None:
        """The id of a token spelled ``text`` exactly (an added/special token), if any."""
        return self._tok.token_to_id(text)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode_prompt(self, text: str) -> list[int]:
        if self.add_bos is None:
            return self._tok.encode(text, add_special_tokens=True).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if self._template is None:
            raise ChatTemplateError(
                "this model has no chat template (tokenizer_config.json "
                "has no 'chat_template'); use a plain completion instead"
            )
        return self._template.render(messages, add_generation_prompt, tools)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        # The template writes the special tokens itself (e.g. bos_token): do not add again.
        text = self.render_chat(messages, add_generation_prompt, tools)
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's own spelling of a token (e.g. byte-level symbols), if any."""
        return self._tok.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        """An added special token (spelled as itself, never as bytes)."""
        added = self._tok.get_added_tokens_decoder().get(token_id)
        return added is not None and added.special


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, never splitting a UTF-8 character.

    Decodes only a short window: the tokens since the last emitted text plus a few before
    them for context (so joining spaces come out right); text is held back while the window
    ends in an incomplete character (decoded as U+FFFD).

        ids:  ... prefix_offset | already emitted | read_offset | new, not yet emitted |
    """

    CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_ids[-self.CONTEXT :])
        self._prefix = 0
        self._read = len(self._ids)

    def add(self, new_ids: list[int]) -> str:
        self._ids.extend(new_ids)
        before = self._tok.decode(self._ids[self._prefix : self._read])
        after = self._tok.decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        # The tokens just emitted become the next window's context.
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Whatever is still held back (e.g. a stream that ended inside a character)."""
        before = self._tok.decode(self._ids[self._prefix : self._read])
        after = self._tok.decode(self._ids[self._prefix :])
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :] if len(after) > len(before) else ""
