"""Grammar-constrained sampling with llguidance.

Why llguidance (of the three libraries the issue names): it is one self-contained Rust
wheel with no Python dependencies (xgrammar pins its own torch, which would pull a second
multi-GB build over our pinned CPU one), it compiles a grammar lazily, so a request's
JSON schema costs well under a millisecond before its first token instead of a full
vocabulary-by-state index (outlines-core builds one per schema), and its Lark dialect
embeds JSON schemas (``%json {...}``) and special tokens, which is what forcing a tool call
in each family's format needs. vLLM and SGLang ship it as a backend too.

    GrammarCompiler (one per engine: the tokenizer's byte trie, built once, lazily)
        .json_schema(schema) / .lark(grammar) -> Constraint (one per sequence)
    Constraint.allowed() -> bool mask over the vocabulary for the next token
    Constraint.advance(token); .done once the grammar can take nothing more
"""

from __future__ import annotations

import json
import threading
from typing import Any

import llguidance
import numpy as np
import torch

from ..errors import INVALID_ARGUMENT, EngineError
from ..tools.formats import JSON_STYLE


class Constraint:
    """One sequence's grammar state. Not thread-safe: the engine's worker owns it."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._m = matcher
        self._vocab = vocab_size
        self._words = np.zeros(((vocab_size + 31) // 32,), dtype=np.int32)

    def allowed(self, logits_width: int) -> torch.Tensor:
        """(logits_width,) bool: the tokens the grammar accepts next (EOS once complete)."""
        self._m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")
        mask = torch.zeros(logits_width, dtype=torch.bool)
        n = min(logits_width, self._vocab)
        mask[:n] = torch.from_numpy(bits[:n].astype(np.bool_))
        return mask

    def advance(self, token: int) -> bool:
        """Feed the sampled token; False if the grammar refused it (cannot happen for a
        token drawn under ``allowed``)."""
        return bool(self._m.consume_token(token))

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more (end the output)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        return str(self._m.get_error()) if self._m.is_error() else ""


class GrammarCompiler:
    """Compiles grammars for one model's tokenizer (``tokenizer_json``: tokenizer.json)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self._json = tokenizer_json
        self._vocab = vocab_size
        self._eos = list(eos_ids)
        self._tok: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()  # (requests are prepared on a thread pool)

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tok is None:
                self._tok = llguidance.LLTokenizer(
                    self._json, n_vocab=self._vocab, eos_token=self._eos or None)
            return self._tok

    def json_schema(self, schema: dict[str, Any], what: str) -> Constraint:
        schema = {**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}}
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        except ValueError as e:
            raise EngineError(INVALID_ARGUMENT, f"{what}: {e}") from None
        return self._compile(grammar, what)

    def lark(self, source: str, what: str) -> Constraint:
        return self._compile(llguidance.LLMatcher.grammar_from_lark(source), what)

    def _compile(self, grammar: str, what: str) -> Constraint:
        tok = self._tokenizer()
        err = llguidance.LLMatcher.validate_grammar(grammar, tok)
        if err and not err.startswith("WARNING"):
            raise EngineError(INVALID_ARGUMENT, f"{what} cannot be enforced: {err}")
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise EngineError(INVALID_ARGUMENT,
                              f"{what} cannot be enforced: {matcher.get_error()}")
        return Constraint(matcher, self._vocab)

    def special_token(self, text: str, token_id: int | None) -> str:
        """How a Lark grammar spells ``text``: its token when the vocabulary has it as one
        special token (the way the model was trained to write it), else the literal."""
        if token_id is not None and self._tokenizer().is_special_token(token_id):
            return f"<[{token_id}]>"
        return json.dumps(text)
