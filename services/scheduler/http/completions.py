"""``POST /v1/chat/completions`` and ``POST /v1/completions``: a body becomes an
``ApiRequest``, its choices run on the nodes (``routing.run_choices``), and their chunks
leave as one OpenAI object or as server-sent events.

A stream's headers wait for its first chunk, so failures before any output (a bad prompt,
no node, an unknown model) keep their HTTP status; a failure after it is an error event.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any
from urllib.parse import quote

from aiohttp import web

from services.scheduler.api import (
    SSE_DONE,
    ApiError,
    ApiRequest,
    ChoiceState,
    Chunk,
    Endpoint,
    Envelope,
    Prompt,
    TokenLogprob,
    chat_logprobs,
    check_input_budget,
    full_response,
    legacy_logprobs,
    new_id,
    parse_json,
    sse,
    stream_chunk,
    tool_call_deltas,
    usage_chunk,
    validate,
)
from services.scheduler.http.state import (
    CLIENT_GONE,
    IGNORED_HEADER,
    NODE_HEADER,
    STATE,
    ApiState,
    call_session,
    read_body,
    retry_key,
    session_header,
    tenant_of,
)
from services.scheduler.http.timing import Timing
from services.scheduler.routing import run_choices

log = logging.getLogger(__name__)


async def _generate(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    state = request.app[STATE]
    tenant = tenant_of(state, request)
    state.tenants.request(tenant)
    _refuse_when_full(state, request, tenant)
    body = parse_json(await read_body(state, request, tenant))
    req = validate(
        body,
        endpoint,
        state.limits,
        session_header=session_header(state, request),
        tenant=tenant,
    )
    if not req.session_id and len(req.prompts) == 1 and req.prompts[0].kind == "chat":
        session = call_session(state, tenant, req.prompts[0].messages,
                               bool(req.guidance.tools_json), new_id("chat"))
        req = dataclasses.replace(req, session_id=session)
    model = await state.dispatcher.resolve_model(req.model)
    check_input_budget(req, state.registry.max_model_len(model))
    if req.ignored_fields:
        state.metrics.ignored_fields.labels(endpoint).inc(len(req.ignored_fields))
    # Refused requests go first as seats free (a retrying client is never starved).
    with state.turns.attempt(tenant, retry_key(request, req.session_id)), \
            state.tenants.in_flight(tenant):
        return await _generate_in_flight(request, state, req, endpoint, model)


def _refuse_when_full(state: ApiState, request: web.Request, tenant: str) -> None:
    """Every node's admission window is full (``routing/window.py``): 429 before the body
    is read or parsed. Under a flood most requests end here, and the scheduler's time
    spent on them is part of every admitted request's wait. The request keeps its place in
    its tenant's line (by its retry token or session header: the body is not read)."""
    if state.dispatcher.windows.all_full(state.registry.healthy()):
        with state.turns.attempt(tenant, retry_key(request, session_header(state, request))):
            raise state.dispatcher.overloaded("", "window_full")


async def _generate_in_flight(request: web.Request, state: ApiState, req: ApiRequest,
                              endpoint: Endpoint, model: str) -> web.StreamResponse:
    env = Envelope(endpoint, new_id(endpoint), model)
    states = {c.index: ChoiceState(c.index, c.prompt_index, echo=_echo(req, c.prompt))
              for c in req.choices()}
    timing = Timing(state.metrics, model, state.dispatcher.catalog.get(model))
    state.metrics.in_flight.inc()
    try:
        async with aclosing(run_choices(state.dispatcher, req, model, env.id,
                                           arrived=timing.start)) as events:
            if req.stream:
                return await _stream(request, req, env, states, timing, events)
            nodes: list[str] = []
            headers = _ignored_header(req)
            async for index, chunk in events:
                states[index].add(chunk)
                timing.tokens(index, len(chunk.token_ids))
                if chunk.node and chunk.node not in nodes:
                    nodes.append(chunk.node)
            if nodes:
                headers[NODE_HEADER] = ",".join(nodes)
            return web.json_response(
                full_response(env, list(states.values()), req.return_token_ids,
                              req.sampling.logprobs >= 0),
                headers=headers or None,
            )
    finally:
        timing.done()
        state.metrics.in_flight.dec()


def _echo(req: ApiRequest, prompt: Prompt) -> str | None:
    """The text an ``echo`` puts first ("": a token-id prompt's, spelled by its tokens)."""
    return (prompt.text if prompt.kind == "text" else "") if req.sampling.echo else None


def _ignored_header(req: ApiRequest) -> dict[str, str]:
    # Percent-encoded: a field's name may hold a comma, a control character or non-ASCII,
    # none of which a header value may carry as is (aiohttp drops the connection).
    names = ",".join(quote(n, safe="") for n in req.ignored_fields)
    return {IGNORED_HEADER: names} if names else {}


def _logprobs(req: ApiRequest, env: Envelope, st: ChoiceState,
              entries: Sequence[TokenLogprob]) -> dict[str, Any] | None:
    """A streamed chunk's log-probabilities (legacy offsets carry on over the stream)."""
    if req.sampling.logprobs < 0:
        return None
    if env.endpoint == "chat":
        return chat_logprobs(entries)
    obj, st.text_offset = legacy_logprobs(entries, st.text_offset)
    return obj


def _chunk_events(
    req: ApiRequest, env: Envelope, st: ChoiceState, chunk: Chunk, first: bool
) -> list[dict[str, Any]]:
    """The OpenAI chunks one engine chunk becomes (a role header first, for chat; the
    echoed prompt first, for completions)."""
    out = []
    ids = req.return_token_ids
    prompt_ids = st.prompt_token_ids if (ids and first) else None
    if first and st.echo is not None:
        out.append(stream_chunk(env, st.index, text=st.echo, prompt_token_ids=prompt_ids,
                                include_usage=req.include_usage,
                                logprobs=_logprobs(req, env, st, st.prompt_logprobs)))
        prompt_ids = None
    if first and env.endpoint == "chat":
        out.append(
            stream_chunk(
                env,
                st.index,
                role=True,
                prompt_token_ids=prompt_ids,
                include_usage=req.include_usage,
            )
        )
        prompt_ids = None
    parts = [part for call in chunk.tool_calls for part in tool_call_deltas(call)]
    finish = chunk.finish_reason or None
    if chunk.text or chunk.token_ids or (finish and not parts):
        out.append(
            stream_chunk(
                env,
                st.index,
                text=chunk.text,
                finish_reason=None if parts else finish,
                token_ids=chunk.token_ids if ids else None,
                prompt_token_ids=prompt_ids,
                include_usage=req.include_usage,
                logprobs=_logprobs(req, env, st, chunk.logprobs),
            )
        )
    # Tool calls after the text of the same piece, then the finish on its own (as OpenAI).
    for part in parts:
        out.append(stream_chunk(env, st.index, tool_calls=part,
                                include_usage=req.include_usage))
    if parts and finish:
        out.append(stream_chunk(env, st.index, finish_reason=finish,
                                include_usage=req.include_usage))
    return out


async def _stream(
    request: web.Request,
    req: ApiRequest,
    env: Envelope,
    states: dict[int, ChoiceState],
    timing: Timing,
    events: AsyncIterator[tuple[int, Chunk]],
) -> web.StreamResponse:
    # Wait for the first chunk before sending headers, so that failures before any output
    # (bad prompt, no node, unknown model) still get their proper HTTP status.
    first = await anext(events, None)
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               **_ignored_header(req)}
    if first is not None and first[1].node:
        headers[NODE_HEADER] = first[1].node  # (other choices may run on other nodes)
    resp = web.StreamResponse(headers=headers)
    await resp.prepare(request)
    seen: set[int] = set()
    try:
        try:
            item = first
            while item is not None:
                index, chunk = item
                st = states[index]
                st.add(chunk)
                timing.tokens(index, len(chunk.token_ids))
                for obj in _chunk_events(req, env, st, chunk, index not in seen):
                    await resp.write(sse(obj))
                seen.add(index)
                item = await anext(events, None)
        except ApiError as e:
            log.warning("stream %s failed after it started: %s", env.id, e.message)
            await resp.write(sse(e.body()))
        if req.include_usage:
            await resp.write(sse(usage_chunk(env, list(states.values()))))
        await resp.write(SSE_DONE)
        await resp.write_eof()
    except ConnectionResetError:
        log.info("client of %s disconnected; cancelling its generation", env.id)
        request[CLIENT_GONE] = True
    return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


def add_completion_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
