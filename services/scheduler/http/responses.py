"""``POST /v1/responses`` (whole or streamed as Responses events), ``GET`` and ``DELETE``
``/v1/responses/{id}``.

A request becomes one chat generation: [instructions] + the stored conversation of
``previous_response_id`` + the new input items, under the chain's session (so the
previous turns' KV is reused); its output (text and function calls) is stored with the
conversation for the next link.

Streamed events, in order (each with a ``sequence_number``):
    response.created, response.in_progress,
    per text message: output_item.added, content_part.added, output_text.delta...,
        output_text.done, content_part.done, output_item.done
    per function call: output_item.added, function_call_arguments.delta,
        function_call_arguments.done, output_item.done
    response.completed (or response.incomplete, response.failed)
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from aiohttp import web

from services.scheduler.api import (
    ApiError,
    ApiRequest,
    ChoiceState,
    Chunk,
    Message,
    Prompt,
    Sampling,
    check_input_budget,
    guidance,
    parse_json,
    responses_body,
)
from services.scheduler.http.state import (
    CLIENT_GONE,
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
from services.scheduler.responses import items
from services.scheduler.routing import run_choices

log = logging.getLogger(__name__)


def _not_found(rid: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"Response with id '{rid}' not found.", param=param,
                    code="response_not_found")


async def create(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    tenant = tenant_of(state, request)
    state.tenants.request(tenant)
    v = responses_body(state.limits).check(parse_json(await read_body(state, request, tenant)))
    rid = items.new_item_id("resp")
    history: tuple[Message, ...] = ()
    session = v.get("session_id") or v.get("prompt_cache_key", "")
    if "previous_response_id" in v:
        prev = await state.responses.get(tenant, v["previous_response_id"])
        if prev is None:
            raise _not_found(v["previous_response_id"], "previous_response_id")
        history, session = prev.messages, session or prev.session_id
    conversation = (*history, *items.to_messages(v["input"]))
    session = (session_header(state, request) or session
               or call_session(state, tenant, conversation, True, rid))
    system = (Message("system", v["instructions"]),) if v.get("instructions") else ()
    req = ApiRequest(
        endpoint="chat", model=v.get("model"),
        prompts=(Prompt("chat", messages=(*system, *conversation)),),
        sampling=Sampling(temperature=v.get("temperature", 1.0), top_p=v.get("top_p", 1.0),
                          max_tokens=v.get("max_output_tokens",
                                           state.limits.default_max_tokens),
                          seed=v.get("seed")),
        stream=v.get("stream", False), session_id=session, tenant=tenant,
        priority=v.get("priority", 0), guidance=guidance(items.chat_guidance_fields(v)))
    model = await state.dispatcher.resolve_model(req.model)
    check_input_budget(req, state.registry.max_model_len(model))
    with state.turns.attempt(tenant, retry_key(request, session)), \
            state.tenants.in_flight(tenant):
        return await _run(request, state, req, v, rid, model, conversation)


async def _run(request: web.Request, state: ApiState, req: ApiRequest, v: dict[str, Any],
               rid: str, model: str, conversation: tuple[Message, ...]) -> web.StreamResponse:
    st = ChoiceState(0, 0)
    timing = Timing(state.metrics, model, state.dispatcher.catalog.get(model))
    state.metrics.in_flight.inc()
    try:
        async with aclosing(run_choices(state.dispatcher, req, model, rid)) as events:
            if req.stream:
                return await _stream(request, state, req, v, rid, model, st, timing, events,
                                     conversation)
            node = ""
            async for _, chunk in events:
                st.add(chunk)
                timing.tokens(0, len(chunk.token_ids))
                node = node or chunk.node
            body = await _finished(state, req, v, rid, model, st, conversation)
            return web.json_response(body, headers={NODE_HEADER: node} if node else None)
    finally:
        timing.done()
        state.metrics.in_flight.dec()


async def _finished(state: ApiState, req: ApiRequest, v: dict[str, Any], rid: str, model: str,
              st: ChoiceState, conversation: tuple[Message, ...],
              output: list[dict[str, Any]] | None = None,
              created: int | None = None) -> dict[str, Any]:
    output = output if output is not None else items.output_items(st, items.new_item_id("msg"))
    body = items.response_object(rid, model, v, req.session_id, status="completed",
                                 output=output, st=st, created=created)
    if v.get("store", True):
        await state.responses.put(req.tenant, body,
                            (*conversation, items.assistant_message(st)), req.session_id)
    return body


class _Events:
    """Numbered Responses stream events written as SSE."""

    def __init__(self, resp: web.StreamResponse) -> None:
        self._resp = resp
        self._seq = 0

    async def send(self, kind: str, **fields: Any) -> None:
        obj = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        data = json.dumps(obj, separators=(",", ":"))
        await self._resp.write(f"event: {kind}\ndata: {data}\n\n".encode())


async def _stream(request: web.Request, state: ApiState, req: ApiRequest, v: dict[str, Any],
                  rid: str, model: str, st: ChoiceState, timing: Timing,
                  events: AsyncIterator[tuple[int, Chunk]],
                  conversation: tuple[Message, ...]) -> web.StreamResponse:
    first = await anext(events, None)  # (failures before any output keep their status)
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    if first is not None and first[1].node:
        headers[NODE_HEADER] = first[1].node
    resp = web.StreamResponse(headers=headers)
    await resp.prepare(request)
    out = _Events(resp)
    shell = items.response_object(rid, model, v, req.session_id, status="in_progress",
                                  output=[])
    output: list[dict[str, Any]] = []
    msg_id = items.new_item_id("msg")
    text_open = False
    try:
        await out.send("response.created", response=shell)
        await out.send("response.in_progress", response=shell)
        try:
            item = first
            while item is not None:
                chunk = item[1]
                st.add(chunk)
                timing.tokens(0, len(chunk.token_ids))
                if chunk.text:
                    if not text_open:
                        text_open = True
                        await _open_text(out, msg_id, len(output))
                    await out.send("response.output_text.delta", item_id=msg_id,
                                   output_index=len(output), content_index=0,
                                   delta=chunk.text, logprobs=[])
                for call in chunk.tool_calls:
                    if text_open:
                        text_open = False
                        output.append(await _close_text(out, msg_id, len(output), st))
                    output.append(await _call(out, call.id, call.name, call.arguments,
                                              len(output)))
                item = await anext(events, None)
        except ApiError as e:
            log.warning("response stream %s failed after it started: %s", rid, e.message)
            failed = {**shell, "status": "failed",
                      "error": {"code": e.code or "server_error", "message": e.message}}
            await out.send("response.failed", response=failed)
            await resp.write_eof()
            return resp
        if text_open or not output:
            if not text_open:
                await _open_text(out, msg_id, len(output))
            output.append(await _close_text(out, msg_id, len(output), st))
        body = await _finished(state, req, v, rid, model, st, conversation, output,
                               shell["created_at"])
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        await out.send(kind, response=body)
        await resp.write_eof()
    except ConnectionResetError:
        log.info("client of %s disconnected; cancelling its generation", rid)
        request[CLIENT_GONE] = True
    return resp


async def _open_text(out: _Events, msg_id: str, index: int) -> None:
    await out.send("response.output_item.added", output_index=index,
                   item=items.message_item(msg_id, "", "in_progress"))
    await out.send("response.content_part.added", item_id=msg_id, output_index=index,
                   content_index=0, part=items.output_text(""))


async def _close_text(out: _Events, msg_id: str, index: int,
                      st: ChoiceState) -> dict[str, Any]:
    text = "".join(st.text)
    await out.send("response.output_text.done", item_id=msg_id, output_index=index,
                   content_index=0, text=text, logprobs=[])
    await out.send("response.content_part.done", item_id=msg_id, output_index=index,
                   content_index=0, part=items.output_text(text))
    done = items.message_item(msg_id, text, "completed")
    await out.send("response.output_item.done", output_index=index, item=done)
    return done


async def _call(out: _Events, call_id: str, name: str, arguments: str,
                index: int) -> dict[str, Any]:
    added = items.call_item(call_id, name, "", "in_progress")
    await out.send("response.output_item.added", output_index=index, item=added)
    await out.send("response.function_call_arguments.delta", item_id=added["id"],
                   output_index=index, delta=arguments)
    await out.send("response.function_call_arguments.done", item_id=added["id"],
                   output_index=index, name=name, arguments=arguments)
    done = items.call_item(call_id, name, arguments, "completed")
    await out.send("response.output_item.done", output_index=index, item=done)
    return done


async def retrieve(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tenant = tenant_of(state, request)
    rid = request.match_info["response_id"]
    stored = await state.responses.get(tenant, rid)
    if stored is None:
        raise _not_found(rid)
    return web.json_response(stored.body)


async def delete(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tenant = tenant_of(state, request)
    rid = request.match_info["response_id"]
    if not await state.responses.delete(tenant, rid):
        raise _not_found(rid)
    return web.json_response({"id": rid, "object": "response", "deleted": True})


def add_responses_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)
