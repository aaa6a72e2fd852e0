"""Per-request output bookkeeping: detokenize, stop conditions, and what text to stream.

Stop strings may span token boundaries, so the text is searched again around every new
delta, and the last ``longest stop - 1`` characters are held back from the stream until
they can no longer begin a stop string:

    text:  "... the answer is 4\\n\\nUs"      stop = "\\n\\nUser:"
                              |<- held ->|   (could still become the stop string)

When a stop string appears, the text is cut where it begins; it never reaches the client.
"""

from __future__ import annotations

from collections.abc import Collection

from .api_types import SamplingParams

STOP = "stop"
LENGTH = "length"
ABORT = "abort"


class OutputState:
    """Feed sampled tokens with ``add``; read the text delta to stream with ``take_text``.

    ``detokenizer`` has ``add(new_ids) -> str`` and ``flush() -> str`` (an
    IncrementalDetokenizer).
    """

    def __init__(
        self,
        detokenizer,
        params: SamplingParams,
        eos_token_ids: Collection[int],
        max_output_tokens: int,
    ) -> None:
        self._detok = detokenizer
        self._params = params
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids.update(eos_token_ids)
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self._max_output_tokens = max_output_tokens
        self.text = ""
        self._sent = 0
        self.num_tokens = 0
        self.finish_reason: str | None = None

    def add(self, token: int) -> str | None:
        """Account one sampled token; returns the finish reason once finished."""
        self.num_tokens += 1
        if token in self._stop_ids:
            self.finish_reason = STOP  # the stop token's text is not part of the output
            return self.finish_reason
        before = len(self.text)
        self.text += self._detok.add([token])
        if self._params.stop and self._find_stop(before):
            self.finish_reason = STOP
        elif self.num_tokens >= self._max_output_tokens:
            self.finish(LENGTH)
        return self.finish_reason

    def _find_stop(self, before: int) -> bool:
        start = max(0, before - self._holdback)
        cut = -1
        for s in self._params.stop:
            i = self.text.find(s, start)
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
        if cut < 0:
            return False
        self.text = self.text[:cut]
        return True

    def finish(self, reason: str) -> None:
        """End without a stop: whatever the detokenizer still holds back is output too."""
        if self.finish_reason is None:
            self.finish_reason = reason
            self.text += self._detok.flush()

    def take_text(self) -> str:
        """Text not streamed yet that can no longer turn into a stop string."""
        end = len(self.text) if self.finish_reason else len(self.text) - self._holdback
        if end <= self._sent:
            return ""
        delta = self.text[self._sent : end]
        self._sent = end
        return delta
