"""What the event loop asks of the engine core, as typed commands in the worker's inbox.

    Add(request, plan)            a request enters the core (with its reuse plan)
    Abort(request_id)             it leaves (its stream ends with finish_reason "abort")
    Unpin(job_id, ok)             a save to the kvstore was answered: its blocks go
    LoadEnded()                   a load RPC ended: parked blocks may be free
    KVStoreAttached(n)            the pool is attached; the kvstore's chunks are n blocks
    Prefetch(order)               an advised session to copy into free device blocks
    EndPrefetch(session, expired) its advisory ended unfollowed

The loop only appends them; ``apply`` runs on the worker thread, in inbox order, before a
step (nothing else touches the core).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.engine_core import EngineCore, Event
from services.engine.offload import PrefetchOrder
from services.engine.reuse_plan import ReusePlan
from services.engine.validation import PreparedRequest
from shared.session_key import SessionKey


@dataclass(frozen=True)
class Add:
    request: PreparedRequest
    plan: ReusePlan | None = None


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Unpin:
    job_id: int
    ok: bool = True


@dataclass(frozen=True)
class LoadEnded:
    pass


@dataclass(frozen=True)
class KVStoreAttached:
    blocks_per_chunk: int


@dataclass(frozen=True)
class Prefetch:
    order: PrefetchOrder


@dataclass(frozen=True)
class EndPrefetch:
    session: SessionKey
    expired: bool = False


Command = Add | Abort | Unpin | LoadEnded | KVStoreAttached | Prefetch | EndPrefetch


def apply(core: EngineCore, command: Command) -> Event | None:
    """(worker thread) Do ``command`` to the core; the event it makes (an abort's last
    output), if any."""
    match command:
        case Add(request, plan):
            core.add(request, plan)
        case Abort(request_id):
            return core.abort(request_id)
        case Unpin(job_id, ok):
            core.unpin(job_id, ok)
        case LoadEnded():
            core.load_ended()
        case KVStoreAttached(blocks_per_chunk):
            core.kvstore_attached(blocks_per_chunk)
        case Prefetch(order):
            core.prefetch(order)
        case EndPrefetch(session, expired):
            core.end_prefetch(session, expired)
    return None
