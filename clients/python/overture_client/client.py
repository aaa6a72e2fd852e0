"""Clients for Overture's API: chat completions under a session, and advisories.

``Overture`` (blocking) and ``AsyncOverture`` share one description of each call
(``_Calls``); only the transport differs. Every advisory and request is also recorded in
``client.events`` (kind, session, monotonic time), so an application can see its
advisories' lead times.

The official ``openai`` client works too: give it ``client.session_headers(session_id)``
as ``default_headers`` or ``extra_headers``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx


class OvertureError(RuntimeError):
    """An error answer of the server (OpenAI's shape), or a failed call."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message, self.code = status, message, code


@dataclass(frozen=True)
class Advisory:
    advisory_id: str
    session_id: str
    node: str
    expires_at: float
    successors: tuple[Advisory, ...] = ()


@dataclass(frozen=True)
class ChatResult:
    content: str
    finish_reason: str
    usage: dict[str, Any]
    node: str
    ttft_s: float  # (the whole answer's time, without streaming)
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def cached_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens_details", {}).get("cached_tokens", 0))


@dataclass(frozen=True)
class Event:
    kind: str  # "advise" | "invalidate" | "request"
    session_id: str
    at: float  # time.monotonic()
    detail: str = ""


def _advisory(body: dict[str, Any]) -> Advisory:
    return Advisory(body["advisory_id"], body["session_id"], body["node"],
                    float(body["expires_at"]),
                    tuple(_advisory(s) for s in body.get("successors", [])))


def _raise_for(r: httpx.Response) -> None:
    if r.status_code < 400:
        return
    try:
        err = r.json()["error"]
        raise OvertureError(r.status_code, err.get("message", ""), err.get("code"))
    except (ValueError, KeyError, TypeError):
        raise OvertureError(r.status_code, r.text[:300]) from None


class _Calls:
    """What each call sends and how its answer is read (no I/O here)."""

    def __init__(self, base_url: str, api_key: str | None, model: str | None) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.model = model
        self.events: list[Event] = []

    def headers(self, session_id: str | None = None) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        if session_id:
            h["X-Session-Id"] = session_id
        return h

    def session_headers(self, session_id: str) -> dict[str, str]:
        """Headers that put an ``openai`` client's request into ``session_id``."""
        return {"X-Session-Id": session_id}

    def chat_request(self, messages: Sequence[dict[str, Any]], session_id: str | None,
                     model: str | None, stream: bool, params: dict[str, Any]
                     ) -> dict[str, Any]:
        """The keyword arguments of a chat completion call (recorded as a request)."""
        body: dict[str, Any] = {"messages": list(messages), **params}
        if model or self.model:
            body["model"] = model or self.model
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        self.record("request", session_id or "")
        return {"url": self.base_url + "/v1/chat/completions",
                "headers": self.headers(session_id), "json": body}

    def advise_request(self, session_id: str, model: str | None, expected_arrival_s: float,
                       priority: int, successors: Sequence[dict[str, Any]]
                       ) -> dict[str, Any]:
        body: dict[str, Any] = {"session_id": session_id, "model": model or self.model,
                                "expected_arrival_s": max(0.0, expected_arrival_s)}
        if priority:
            body["priority"] = priority
        if successors:
            body["successors"] = [{"model": model or self.model, **s} for s in successors]
        return {"url": self.base_url + "/v1/advisory", "headers": self.headers(), "json": body}

    def advised(self, r: httpx.Response) -> Advisory:
        _raise_for(r)
        adv = _advisory(r.json())
        self.record_advisory(adv)
        return adv

    def invalidate_request(self, advisory_id: str) -> dict[str, Any]:
        return {"url": f"{self.base_url}/v1/advisory/{advisory_id}",
                "headers": self.headers()}

    def invalidated(self, r: httpx.Response, advisory_id: str, session_id: str) -> bool:
        """Whether it was still pending (a followed or expired one is gone already)."""
        self.record("invalidate", session_id, advisory_id)
        if r.status_code == 404:
            return False
        _raise_for(r)
        return True

    def record(self, kind: str, session_id: str, detail: str = "") -> None:
        self.events.append(Event(kind, session_id, time.monotonic(), detail))

    def record_advisory(self, adv: Advisory) -> None:
        for a in (adv, *adv.successors):
            self.record("advise", a.session_id, a.advisory_id)

    @staticmethod
    def result(r: httpx.Response, started: float) -> ChatResult:
        _raise_for(r)
        body = r.json()
        choice = body["choices"][0]
        return ChatResult(choice["message"]["content"], choice["finish_reason"], body["usage"],
                          r.headers.get("X-Overture-Node", ""), time.monotonic() - started,
                          body)


def _sse_lines_to_deltas(line: str) -> tuple[str | None, bool]:
    """(text delta or None, done) of one SSE line."""
    if not line.startswith("data:"):
        return None, False
    data = line[5:].strip()
    if data == "[DONE]":
        return None, True
    chunk = json.loads(data)
    if "error" in chunk:
        raise OvertureError(500, chunk["error"].get("message", "stream failed"))
    choices = chunk.get("choices") or []
    if choices and choices[0].get("delta", {}).get("content"):
        return choices[0]["delta"]["content"], False
    return None, False


class Overture(_Calls):
    """Blocking client."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 model: str | None = None, timeout_s: float = 120.0) -> None:
        super().__init__(base_url, api_key, model)
        self.http = httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Overture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def chat(self, messages: Sequence[dict[str, Any]], *, session_id: str | None = None,
             model: str | None = None, **params: Any) -> ChatResult:
        started = time.monotonic()
        r = self.http.post(**self.chat_request(messages, session_id, model, False, params))
        return self.result(r, started)

    def chat_stream(self, messages: Sequence[dict[str, Any]], *, session_id: str | None = None,
                    model: str | None = None, **params: Any) -> Iterator[str]:
        call = self.chat_request(messages, session_id, model, True, params)
        with self.http.stream("POST", **call) as r:
            if r.status_code >= 400:
                r.read()
                _raise_for(r)
            for line in r.iter_lines():
                text, done = _sse_lines_to_deltas(line)
                if done:
                    return
                if text:
                    yield text

    def advise(self, session_id: str, model: str | None = None, expected_arrival_s: float = 0.0,
               priority: int = 0, successors: Sequence[dict[str, Any]] = ()) -> Advisory:
        return self.advised(self.http.post(**self.advise_request(
            session_id, model, expected_arrival_s, priority, successors)))

    def invalidate(self, advisory_id: str, session_id: str = "") -> bool:
        """Whether it was still pending (a followed or expired one is gone already)."""
        r = self.http.delete(**self.invalidate_request(advisory_id))
        return self.invalidated(r, advisory_id, session_id)


class AsyncOverture(_Calls):
    """asyncio client."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 model: str | None = None, timeout_s: float = 120.0) -> None:
        super().__init__(base_url, api_key, model)
        self.http = httpx.AsyncClient(timeout=timeout_s)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncOverture:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def chat(self, messages: Sequence[dict[str, Any]], *, session_id: str | None = None,
                   model: str | None = None, **params: Any) -> ChatResult:
        started = time.monotonic()
        r = await self.http.post(**self.chat_request(messages, session_id, model, False,
                                                     params))
        return self.result(r, started)

    async def chat_stream(self, messages: Sequence[dict[str, Any]], *,
                          session_id: str | None = None, model: str | None = None,
                          **params: Any) -> AsyncIterator[str]:
        call = self.chat_request(messages, session_id, model, True, params)
        async with self.http.stream("POST", **call) as r:
            if r.status_code >= 400:
                await r.aread()
                _raise_for(r)
            async for line in r.aiter_lines():
                text, done = _sse_lines_to_deltas(line)
                if done:
                    return
                if text:
                    yield text

    async def advise(self, session_id: str, model: str | None = None,
                     expected_arrival_s: float = 0.0, priority: int = 0,
                     successors: Sequence[dict[str, Any]] = ()) -> Advisory:
        return self.advised(await self.http.post(**self.advise_request(
            session_id, model, expected_arrival_s, priority, successors)))

    async def invalidate(self, advisory_id: str, session_id: str = "") -> bool:
        r = await self.http.delete(**self.invalidate_request(advisory_id))
        return self.invalidated(r, advisory_id, session_id)
