"""Run every choice of a request (``n`` samples of each prompt) and merge their chunks.

Yields ``(choice_index, Chunk)`` in arrival order. The first failure of any choice is raised
to the consumer; closing the iterator cancels every generation still running.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

from services.scheduler import wire
from services.scheduler.api import ApiError, ApiRequest, Choice, Chunk
from services.scheduler.cluster import prompt_prefix
from services.scheduler.routing.dispatch import Dispatcher
from services.scheduler.routing.plan import RouteRequest

log = logging.getLogger(__name__)

_DONE = object()


def _request_id(base_id: str, choice: Choice, total: int) -> str:
    return base_id if total == 1 else f"{base_id}-{choice.index}"


def _leading_context(req: ApiRequest, model: str) -> tuple[str, ...]:
    """The chat's leading context as ``PrefixIndex`` keys (none for other prompts)."""
    if len(req.prompts) != 1 or req.prompts[0].kind != "chat":
        return ()
    msgs = [(m.role, m.content + "".join(f"\0{c.name}\0{c.arguments}" for c in m.tool_calls))
            for m in req.prompts[0].messages]
    return prompt_prefix(req.tenant, model, req.guidance.tools_json, msgs)


async def run_choices(
    dispatcher: Dispatcher, req: ApiRequest, model: str, base_id: str, arrived: float = 0.0
) -> AsyncGenerator[tuple[int, Chunk], None]:
    """``arrived``: ``time.monotonic()`` the request arrived (its queue limit runs from
    then; 0.0: now)."""
    route = RouteRequest(model, req.session_id, req.tenant, req.priority,
                         advised=dispatcher.advised_node(req.tenant, req.session_id),
                         prefix=_leading_context(req, model),
                         arrived=arrived or time.monotonic())
    choices = req.choices()
    protos = [
        wire.generate_request(req, c, model, _request_id(base_id, c, len(choices))) for c in choices
    ]
    if len(choices) == 1:
        # The common case needs no tasks: stream the one generation directly.
        async with aclosing(dispatcher.generate(protos[0], route)) as chunks:
            async for chunk in chunks:
                yield choices[0].index, chunk
        return

    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(choice: Choice, proto: wire.GenerateProto) -> None:
        try:
            async with aclosing(dispatcher.generate(proto, route)) as chunks:
                async for chunk in chunks:
                    queue.put_nowait((choice.index, chunk))
            queue.put_nowait((choice.index, _DONE))
        except ApiError as e:
            queue.put_nowait((choice.index, e))
        except Exception as e:  # surfaced to the consumer as a 500, with the cause logged
            log.exception("choice %d of %s failed", choice.index, base_id)
            queue.put_nowait((choice.index, ApiError(500, f"internal error: {e}")))

    tasks = [asyncio.create_task(pump(c, p)) for c, p in zip(choices, protos, strict=True)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, ApiError):
                raise item
            else:
                yield index, item  # type: ignore[misc]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
