"""The node's kvstore's answers (event loop) as commands for the worker: the engine's
``KVStoreAnswers``, given to its ``KVStoreLink``."""

from __future__ import annotations

from typing import Protocol

from services.engine.worker.commands import Command, KVStoreAttached, LoadEnded, Unpin


class Inbox(Protocol):
    def submit(self, command: Command) -> None: ...


class InboxAnswers:
    def __init__(self, inbox: Inbox) -> None:
        self._inbox = inbox

    def save_answered(self, job_id: int, ok: bool) -> None:
        self._inbox.submit(Unpin(job_id, ok))

    def load_ended(self) -> None:
        self._inbox.submit(LoadEnded())

    def attached(self, blocks_per_chunk: int) -> None:
        self._inbox.submit(KVStoreAttached(blocks_per_chunk))
