"""Replay a trace against a running cluster, as its users would: each session's turns in
order, each advised when its user starts typing and sent when they finish, every time
shifted by how long the previous answers really took (a user reads an answer only once it
is there). Spurious advisories are sent and left to expire, unfollowed.

Per request: time to first token, time per output token after it, end to end, output and
cached tokens, and the node; ``summary`` condenses them (normalized latency: end to end per
output token, as Symphony §4 reports it).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import aiohttp

from bench.workloads.trace import Session, Trace


@dataclass(frozen=True)
class Result:
    session_id: str
    turn: int
    advised: bool
    priority: int
    sent_at: float  # seconds since the replay started
    ttft_s: float
    e2e_s: float
    output_tokens: int
    cached_tokens: int
    node: str
    error: str = ""
    retries: int = 0  # 429s (every node at capacity) waited out before it was served

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / max(1, self.output_tokens - 1)


class Replayer:
    def __init__(self, url: str, model: str, api_key: str | None = None,
                 time_scale: float = 1.0, max_answer_tokens: int = 1024,
                 max_retries: int = 30) -> None:
        self.url, self.model = url.rstrip("/"), model
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.time_scale = time_scale  # (0.1: ten times faster than people)
        self.max_answer_tokens = max_answer_tokens
        self.max_retries = max_retries
        self.results: list[Result] = []
        self.advisories = 0

    async def run(self, trace: Trace) -> list[Result]:
        self._t0 = time.monotonic()
        async with aiohttp.ClientSession(headers=self.headers) as http:
            await asyncio.gather(*(self._session(http, s) for s in trace.sessions))
        return self.results

    async def _at(self, t: float) -> None:
        delay = t * self.time_scale - (time.monotonic() - self._t0)
        if delay > 0:
            await asyncio.sleep(delay)

    async def _advise(self, http: aiohttp.ClientSession, s: Session) -> None:
        body = {"session_id": s.session_id, "model": self.model, "priority": s.priority}
        async with http.post(self.url + "/v1/advisory", json=body) as r:
            await r.read()
            self.advisories += r.status == 202

    async def _session(self, http: aiohttp.ClientSession, s: Session) -> None:
        history: list[dict[str, str]] = []
        shift = 0.0  # how much later than the trace assumed the answers came
        for at in s.spurious_at:  # (abandoned drafts: advised, never sent)
            asyncio.get_running_loop().create_task(self._later_advise(http, s, at))
        for i, turn in enumerate(s.turns):
            if turn.advisory_at is not None:
                await self._at(turn.advisory_at + shift)
                await self._advise(http, s)
            await self._at(turn.request_at + shift)
            history.append({"role": "user", "content": turn.text})
            result, answer = await self._turn(http, s, i, turn.answer_tokens, history,
                                              turn.advisory_at is not None)
            self.results.append(result)
            history.append({"role": "assistant", "content": answer})
            # The trace assumed the answer was there at once: later turns move by its time.
            shift += result.e2e_s / self.time_scale

    async def _later_advise(self, http: aiohttp.ClientSession, s: Session, at: float) -> None:
        await self._at(at)
        await self._advise(http, s)

    async def _turn(self, http: aiohttp.ClientSession, s: Session, index: int, tokens: int,
                    history: list[dict[str, str]], advised: bool) -> tuple[Result, str]:
        body = {"model": self.model, "messages": history, "temperature": 0,
                "ignore_eos": True, "max_tokens": min(tokens, self.max_answer_tokens),
                "priority": s.priority}
        sent = time.monotonic()
        got = await stream_chat(http, self.url, body, {"X-Session-Id": s.session_id},
                                self.max_retries)
        result = Result(s.session_id, index, advised, s.priority, sent - self._t0,
                        got.ttft_s, got.e2e_s, got.completion_tokens, got.cached_tokens,
                        got.node, got.error, got.retries)
        return result, got.text


@dataclass
class Streamed:
    """One streamed chat completion as its client saw it."""

    ttft_s: float = 0.0  # to the first content (the whole call when none came)
    e2e_s: float = 0.0
    text: str = ""
    usage: dict = field(default_factory=dict)
    node: str = ""
    error: str = ""  # "" when it was served
    retries: int = 0

    @property
    def completion_tokens(self) -> int:
        return int(self.usage.get("completion_tokens", 0))

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens", 0))

    @property
    def cached_tokens(self) -> int:
        return int((self.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


async def stream_chat(http: aiohttp.ClientSession, url: str, body: dict,
                      headers: dict[str, str] | None = None, max_retries: int = 0
                      ) -> Streamed:
    """POST ``body`` as a streamed chat completion (usage included) and time it. A 429
    (every node at capacity) is waited out (``Retry-After``) and sent again, up to
    ``max_retries`` times, as OpenAI clients do; the wait counts in the latency."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    out, parts = Streamed(), []
    sent = time.monotonic()
    ttft = None
    try:
        while True:
            async with http.post(url + "/v1/chat/completions", json=body,
                                 headers=headers or {}) as r:
                if r.status == 429 and out.retries < max_retries:
                    out.retries += 1
                    await r.read()
                    await asyncio.sleep(_retry_after(r.headers.get("Retry-After")))
                    continue
                out.node = r.headers.get("X-Overture-Node", "")
                if r.status != 200:
                    out.error = f"{r.status} {(await r.text())[:200]}"
                    break
                async for raw in r.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    for c in chunk.get("choices") or []:
                        if c.get("delta", {}).get("content"):
                            ttft = ttft if ttft is not None else time.monotonic() - sent
                            parts.append(c["delta"]["content"])
                    out.usage = chunk.get("usage") or out.usage
                break
    except aiohttp.ClientError as e:
        out.error = str(e)
    out.e2e_s = time.monotonic() - sent
    out.ttft_s = ttft if ttft is not None else out.e2e_s
    out.text = "".join(parts)
    return out


def _retry_after(value: str | None) -> float:
    """Seconds a 429 asks to wait (1 when absent or not a number of seconds)."""
    try:
        return min(60.0, max(0.0, float(value or 1)))
    except ValueError:
        return 1.0


def summary(results: list[Result]) -> dict[str, float]:
    ok = [r for r in results if not r.error]
    if not ok:
        return {"requests": float(len(results)), "errors": float(len(results))}

    def pct(values: list[float], p: float) -> float:
        values = sorted(values)
        return values[min(len(values) - 1, int(p * len(values)))]

    ttft = [r.ttft_s for r in ok]
    span = max(r.sent_at + r.e2e_s for r in ok) - min(r.sent_at for r in ok)
    return {
        "requests": float(len(results)), "errors": float(len(results) - len(ok)),
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_p50_s": statistics.median(ttft), "ttft_p95_s": pct(ttft, 0.95),
        "tpot_mean_s": statistics.mean(r.tpot_s for r in ok),
        "normalized_latency_s": statistics.mean(r.e2e_s / max(1, r.output_tokens)
                                                for r in ok),
        "requests_per_s": len(ok) / span if span > 0 else 0.0,
        "cached_tokens_mean": statistics.mean(r.cached_tokens for r in ok),
        "retried": float(sum(r.retries > 0 for r in ok)),
    }
