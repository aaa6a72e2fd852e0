"""How a single token is spelled in log-probabilities: its text and its UTF-8 bytes.

OpenAI gives each token of ``logprobs`` as ``token`` (text) and ``bytes`` (the raw bytes,
so that a character split over several tokens can be put back together). A token decoded
alone may be part of a character:

    byte-level BPE (GPT-2, Llama 3, Qwen2): the token's symbols map back to bytes through
        the fixed byte <-> symbol table of GPT-2 (``_byte_symbols``);
    SentencePiece byte fallback (Llama 2, Mistral): ``<0xE2>`` is the byte 0xE2;
    anything else: the token decoded alone, as UTF-8.

Where the bytes are not whole UTF-8 the text shows them escaped (``\\xe2``), as OpenAI
does. Spellings are cached per id (a vocabulary is finite; a worker thread owns it).
"""

from __future__ import annotations

import json
import re

from .api_types import TokenLogprob, TopLogprob
from .model.tokenizer import Tokenizer
from .sampling import RowLogprobs

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_symbols() -> dict[str, int]:
    """GPT-2's table: printable bytes are themselves, the others shifted past 255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in keep}
    n = 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + n)] = b
            n += 1
    return table


def _is_byte_level(tokenizer: Tokenizer) -> bool:
    try:
        decoder = json.loads(tokenizer.to_json()).get("decoder") or {}
    except ValueError:
        return False
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or []]
    return "ByteLevel" in kinds


class TokenText:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._symbols = _byte_symbols() if _is_byte_level(tokenizer) else None
        self._cache: dict[int, tuple[str, bytes]] = {}

    def spell(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._spell(token_id)
        return hit

    def _spell(self, token_id: int) -> tuple[str, bytes]:
        piece = self._tok.id_to_token(token_id)
        raw: bytes | None = None
        if piece is not None and not self._tok.is_special(token_id):
            m = _BYTE_TOKEN.match(piece)
            if m is not None:
                raw = bytes([int(m.group(1), 16)])
            elif self._symbols is not None and all(c in self._symbols for c in piece):
                raw = bytes(self._symbols[c] for c in piece)
        if raw is None:
            raw = self._tok.decode([token_id], skip_special_tokens=False).encode()
        return raw.decode("utf-8", errors="backslashreplace"), raw

    def token(self, row: RowLogprobs) -> TokenLogprob:
        """A sampled token's entry from the sampler's numbers."""
        text, raw = self.spell(row.token_id)
        return TokenLogprob(row.token_id, text, raw, row.logprob, self.top(row))

    def top(self, row: RowLogprobs) -> tuple[TopLogprob, ...]:
        return tuple(TopLogprob(t, *self.spell(t), lp)
                     for t, lp in zip(row.top_ids, row.top_logprobs, strict=True))
