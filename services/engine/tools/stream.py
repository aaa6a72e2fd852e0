"""Split a streamed output into content and tool calls as it is generated.

    "Let me check.<tool_call>\\n{...}\\n</tool_call>"
     |-- content --||------ held until its end, then one ToolCall ------|

Content streams at once except a tail that could still begin a call marker; a call is
held until its block ends (or the output does), then parsed whole: its name and its
arguments go out together (the API layer streams the name first, then the arguments). A
block that does not parse as a call of a declared function goes out as content. Content
that is only whitespace around calls is dropped.
"""

from __future__ import annotations

from ..api_types import ToolCall
from .formats import ToolFormat


class ToolCallStream:
    def __init__(self, fmt: ToolFormat, names: list[str], parallel: bool = True) -> None:
        self._fmt = fmt
        self._names = names
        self._parallel = parallel  # False: calls after the first are dropped
        self._buf = ""
        self._in_call = False
        self._at_start = True  # nothing but whitespace seen yet
        self._held_ws = ""  # whitespace-only content, held (dropped if calls follow)
        self._opened = ""  # the marker that opened the call being held
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while self._step(content, calls):
            pass
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The output ended: parse what is held."""
        content: list[str] = []
        calls: list[ToolCall] = []
        while self._step(content, calls):
            pass
        if self._in_call:
            self._close(self._buf, content, calls, unterminated=True)
        else:
            self._emit(self._buf, content)
        self._buf = ""
        self._in_call = False
        if self._held_ws and not self.num_calls:
            content.append(self._held_ws)
        self._held_ws = ""
        return "".join(content), calls

    # ---- internals ----------------------------------------------------------------------
    def _step(self, content: list[str], calls: list[ToolCall]) -> bool:
        f, buf = self._fmt, self._buf
        if not self._in_call:
            if self._at_start and f.leads:
                lead = buf.lstrip()
                if not lead or (len(lead) < len(f.start) and f.start.startswith(lead)):
                    return False  # (nothing yet, or perhaps the marker: wait)
                if lead[0] in f.leads and not lead.startswith(f.start):
                    self._in_call = True
                    self._opened = ""  # no marker: the block is the rest of the output
                    self._buf = lead
                    self._at_start = False
                    return True
            if buf.strip():
                self._at_start = False
            i = buf.find(f.start)
            if i >= 0:
                self._emit(buf[:i], content)
                self._held_ws = ""  # (whitespace before a call is not content)
                self._buf = buf[i + len(f.start):]
                self._in_call = True
                self._opened = f.start
                self._at_start = False
                return True
            keep = _partial_suffix(buf, f.start)
            self._emit(buf[: len(buf) - keep], content)
            self._buf = buf[len(buf) - keep:]
            return False
        if not f.end:
            return False  # runs to the end of the output
        j = buf.find(f.end)
        if j < 0:
            return False
        self._buf = buf[j + len(f.end):]
        self._in_call = False
        self._close(buf[:j], content, calls)
        return True

    def _close(self, block: str, content: list[str], calls: list[ToolCall],
               unterminated: bool = False) -> None:
        parsed = self._fmt.parse_block(block, self._names)
        if parsed is None:
            tail = "" if unterminated else self._fmt.end
            self._emit(self._opened + block + tail, content)
            return
        for c in parsed:
            if self.num_calls and not self._parallel:
                return
            calls.append(ToolCall(c.id, c.name, c.arguments, self.num_calls))
            self.num_calls += 1

    def _emit(self, text: str, content: list[str]) -> None:
        """Content out, but trailing whitespace held until more content follows (dropped
        if a call does), so that the split does not depend on how the text was chunked."""
        body = text.rstrip()
        if body:
            content.append(self._held_ws + body)
            self._held_ws = ""
        self._held_ws += text[len(body):]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
