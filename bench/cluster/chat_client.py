"""One aiohttp client of the overload bench: streamed ``/v1/chat/completions`` requests
with a short prompt that differs per request (no prefix-cache shortcut), ``ignore_eos``,
temperature 0, each ending in one ``Result``: its outcome, time to first token, tokens.
``request`` never raises (but is cancellable): a refusal, a timeout, an SSE error event, a
cut stream or a connection failure is an outcome, counted by the caller.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

import aiohttp

OUTCOMES = ("200", "429", "503", "timeout", "error", "other")
WORDS = (  # prompt words; a random draw of them per request
    "river", "stone", "light", "garden", "window", "quiet", "morning", "paper", "city",
    "music", "orange", "winter", "station", "letter", "market", "bridge", "forest", "silver",
    "number", "doctor", "kitchen", "island", "teacher", "engine", "harbor", "cloud", "yellow",
    "basket", "mountain", "story", "planet", "candle", "ladder", "village",
)


@dataclass
class Result:
    outcome: str  # one of OUTCOMES
    start: float  # perf_counter at send
    latency: float  # seconds until done / failed
    ttft: float | None = None  # seconds to the first token (200s)
    tokens: int = 0  # completion tokens (usage, else streamed content chunks)
    detail: str = ""  # status, error code or exception type of a failure
    retry_after: str | None = None  # Retry-After of a 429

    @property
    def end(self) -> float:
        return self.start + self.latency


class Client:
    """One aiohttp session against the cluster; ``request`` never raises (but cancels)."""

    def __init__(self, url: str, model: str, rng: random.Random) -> None:
        self.url = url + "/v1/chat/completions"
        self.model = model
        self.rng = rng
        self.sent = 0
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        conn = aiohttp.TCPConnector(limit=0, force_close=False)
        self.session = aiohttp.ClientSession(connector=conn)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()

    def prompt(self) -> str:
        """A few dozen tokens, different per request (no prefix-cache shortcut)."""
        self.sent += 1
        words = " ".join(self.rng.choice(WORDS) for _ in range(24))
        return f"Request {self.sent}-{self.rng.randrange(10**9)}: tell a story about {words}."

    async def request(self, max_tokens: int, timeout: float) -> Result:
        body = {"model": self.model, "stream": True, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": self.prompt()}]}
        assert self.session is not None
        t0 = time.perf_counter()
        ttft: float | None = None
        chunks = tokens = 0
        try:
            async with self.session.post(self.url, json=body,
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    await resp.read()
                    status = str(resp.status)
                    return Result(status if status in OUTCOMES else "other", t0,
                                  time.perf_counter() - t0, detail=status,
                                  retry_after=resp.headers.get("Retry-After"))
                done = False
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        err = obj["error"] or {}
                        return Result("error", t0, time.perf_counter() - t0, ttft,
                                      detail="sse:" + str(err.get("code") or err.get("type")))
                    if obj.get("usage"):
                        tokens = int(obj["usage"].get("completion_tokens", 0))
                    for ch in obj.get("choices") or ():
                        delta = ch.get("delta") or {}
                        # The role header ({"role", "content": ""}) comes with the first
                        # token's chunk; anything else is a token (or the finish).
                        if ttft is None and (delta.get("content") or "role" not in delta
                                             or ch.get("finish_reason")):
                            ttft = time.perf_counter() - t0
                        if delta.get("content"):
                            chunks += 1
                if not done:
                    return Result("error", t0, time.perf_counter() - t0, ttft,
                                  detail="stream cut")
                return Result("200", t0, time.perf_counter() - t0, ttft, tokens or chunks)
        except TimeoutError:
            return Result("timeout", t0, time.perf_counter() - t0, ttft, detail="timeout")
        except (aiohttp.ClientError, OSError, ValueError) as e:
            return Result("error", t0, time.perf_counter() - t0, ttft,
                          detail=type(e).__name__)
