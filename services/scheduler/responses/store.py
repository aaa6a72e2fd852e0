"""Stored responses: per tenant, each kept ``ttl_s`` after it was made; the most recent
``max_items`` per tenant in memory (least recently used dropped first), every one also in
the archive (``archive.py``: local disk or the shared S3), written before the client gets
the response, so that ``previous_response_id`` resolves after a scheduler restart."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from services.scheduler.api import ApiError, Message, ToolCall
from services.scheduler.responses.archive import (
    RESPONSE_ID,
    ArchiveUnavailable,
    NullArchive,
    ResponseArchive,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as it was returned
    messages: tuple[Message, ...]  # the conversation through this response's output
    session_id: str
    expires: float  # wall-clock seconds (the record outlives the process)


def encode(item: StoredResponse) -> bytes:
    return json.dumps({"v": 1, "body": item.body, "session_id": item.session_id,
                       "expires": item.expires,
                       "messages": [asdict(m) for m in item.messages]}).encode()


def decode(record: bytes) -> StoredResponse:
    """Raises ValueError (or KeyError/TypeError) for a record that is not one."""
    d = json.loads(record)
    messages = tuple(Message(m["role"], m["content"],
                             tuple(ToolCall(**c) for c in m["tool_calls"]),
                             m["tool_call_id"], m["name"]) for m in d["messages"])
    return StoredResponse(d["body"], messages, d["session_id"], float(d["expires"]))


def _unavailable(e: ArchiveUnavailable) -> ApiError:
    return ApiError(503, f"the response store is unavailable ({e}); retry shortly",
                    code="response_store_unavailable")


class ResponseStore:
    def __init__(self, ttl_s: float, max_items: int,
                 clock: Callable[[], float] = time.time,
                 archive: ResponseArchive | None = None) -> None:
        self.ttl_s = ttl_s
        self.max_items = max_items
        self._clock = clock
        self.archive: ResponseArchive = archive if archive is not None else NullArchive()
        self._by_tenant: dict[str, OrderedDict[str, StoredResponse]] = {}

    async def put(self, tenant: str, body: dict[str, Any], messages: tuple[Message, ...],
                  session_id: str) -> None:
        """Keep a response. An archive that cannot take it leaves it in memory only (the
        chain still works until this process ends; logged)."""
        item = StoredResponse(body, messages, session_id, self._clock() + self.ttl_s)
        self._remember(tenant, body["id"], item)
        try:
            await asyncio.to_thread(self.archive.save, tenant, body["id"], encode(item))
        except ArchiveUnavailable as e:
            log.warning("response %s kept in memory only: %s", body["id"], e)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The response, from memory or the archive; None when unknown or expired.
        Raises ApiError 503 when the archive cannot be read."""
        book = self._by_tenant.get(tenant)
        item = book.get(response_id) if book is not None else None
        if item is None and RESPONSE_ID.match(response_id):
            try:
                record = await asyncio.to_thread(self.archive.load, tenant, response_id)
            except ArchiveUnavailable as e:
                raise _unavailable(e) from None
            item = self._decode(response_id, record) if record is not None else None
            if item is not None:
                self._remember(tenant, response_id, item)
        if item is None:
            return None
        if item.expires <= self._clock():
            await self.delete(tenant, response_id)
            return None
        self._by_tenant[tenant].move_to_end(response_id)
        return item

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Forget a response; whether it existed. Raises ApiError 503 as ``get``."""
        known = self._by_tenant.get(tenant, OrderedDict()).pop(response_id, None) is not None
        if not RESPONSE_ID.match(response_id):
            return known
        try:
            if not known:
                known = await asyncio.to_thread(self.archive.load, tenant,
                                                response_id) is not None
            await asyncio.to_thread(self.archive.delete, tenant, response_id)
        except ArchiveUnavailable as e:
            raise _unavailable(e) from None
        return known

    def expired(self, record: bytes) -> bool:
        """Whether an archived record is past its time (unreadable ones count as expired)."""
        try:
            return decode(record).expires <= self._clock()
        except (ValueError, KeyError, TypeError):
            return True

    def __len__(self) -> int:
        return sum(len(b) for b in self._by_tenant.values())

    def _decode(self, response_id: str, record: bytes) -> StoredResponse | None:
        try:
            return decode(record)
        except (ValueError, KeyError, TypeError) as e:
            log.warning("stored response %s is unreadable (%s); treated as unknown",
                        response_id, e)
            return None

    def _remember(self, tenant: str, response_id: str, item: StoredResponse) -> None:
        book = self._by_tenant.setdefault(tenant, OrderedDict())
        self._expire(book)
        book[response_id] = item
        book.move_to_end(response_id)
        while len(book) > self.max_items:
            book.popitem(last=False)

    def _expire(self, book: OrderedDict[str, StoredResponse]) -> None:
        """Drop expired items from the least recently used end (others go when read)."""
        now = self._clock()
        while book and next(iter(book.values())).expires <= now:
            book.popitem(last=False)
