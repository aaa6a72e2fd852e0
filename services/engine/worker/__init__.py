"""The engine's worker: the one thread that owns the EngineCore (``worker``), fed typed
commands (``commands``: Add, Abort, Unpin, LoadEnded, KVStoreAttached, Prefetch,
EndPrefetch); the kvstore's answers become commands too (``answers``)."""

from services.engine.worker.answers import InboxAnswers
from services.engine.worker.commands import (
    Abort,
    Add,
    Command,
    EndPrefetch,
    KVStoreAttached,
    LoadEnded,
    Prefetch,
    Unpin,
    apply,
)
from services.engine.worker.worker import OutputSink, Worker

__all__ = [
    "Abort",
    "Add",
    "Command",
    "EndPrefetch",
    "InboxAnswers",
    "KVStoreAttached",
    "LoadEnded",
    "OutputSink",
    "Prefetch",
    "Unpin",
    "Worker",
    "apply",
]
