"""Stored responses: per tenant, each kept ``ttl_s`` after it was made, at most ``max_items``
per tenant (least recently used dropped first)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.scheduler.api import Message


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as it was returned
    messages: tuple[Message, ...]  # the conversation through this response's output
    session_id: str
    expires: float


class ResponseStore:
    def __init__(self, ttl_s: float, max_items: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_items = max_items
        self._clock = clock
        self._by_tenant: dict[str, OrderedDict[str, StoredResponse]] = {}

    def put(self, tenant: str, body: dict[str, Any], messages: tuple[Message, ...],
            session_id: str) -> None:
        book = self._by_tenant.setdefault(tenant, OrderedDict())
        self._expire(book)
        book[body["id"]] = StoredResponse(body, messages, session_id,
                                          self._clock() + self.ttl_s)
        while len(book) > self.max_items:
            book.popitem(last=False)

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        book = self._by_tenant.get(tenant)
        if book is None:
            return None
        item = book.get(response_id)
        if item is None or item.expires <= self._clock():
            book.pop(response_id, None)
            return None
        book.move_to_end(response_id)
        return item

    def delete(self, tenant: str, response_id: str) -> bool:
        return self._by_tenant.get(tenant, OrderedDict()).pop(response_id, None) is not None

    def __len__(self) -> int:
        return sum(len(b) for b in self._by_tenant.values())

    def _expire(self, book: OrderedDict[str, StoredResponse]) -> None:
        """Drop expired items from the least recently used end (others go when read)."""
        now = self._clock()
        while book and next(iter(book.values())).expires <= now:
            book.popitem(last=False)
