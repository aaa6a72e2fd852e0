"""Which calls (LoadIntoPool, SaveFromPool) may still touch an engine's pool blocks.

An engine that gives up on a call (its deadline passed, the connection dropped) cannot see
when our side stops: a read or copy under way runs to its end on a thread, whatever the
client does. Before it lets anyone else have those blocks it asks ``FencePoolOp(op_id)``,
which returns once that call can no longer touch the pool:

    running  ──(copies done, call over)──► ended     fence waits for this
    unknown  ──fence──► ended (refused if it ever arrives: a request delayed in transit)

Ids are the engine's (unique per engine process); "" opts out (tests, old clients).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from services.kvstore.engine_path.attach import PoolError

# Ended and fenced ids remembered, so a request that arrives after its fence is refused.
# A request would have to be delayed past this many later calls to slip through.
REMEMBERED_OPS = 65_536


class PoolOps:
    def __init__(self, remembered: int = REMEMBERED_OPS) -> None:
        self._running: dict[str, asyncio.Event] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._remembered = remembered

    def begin(self, op_id: str) -> None:
        """A call starts touching the pool (raises ``PoolError`` for a used or fenced id)."""
        if not op_id:
            return
        _check_op_id(op_id)
        if op_id in self._running or op_id in self._ended:
            raise PoolError(f"pool op {op_id!r} already ran or was fenced; ids are single-use")
        self._running[op_id] = asyncio.Event()

    def end(self, op_id: str) -> None:
        """The call is over and touches the pool no more."""
        done = self._running.pop(op_id, None)
        if done is not None:
            self._retire(op_id)
            done.set()

    async def fence(self, op_id: str) -> None:
        """Return once ``op_id`` can no longer touch the pool (see the module doc)."""
        if not op_id:
            return
        _check_op_id(op_id)
        running = self._running.get(op_id)
        if running is None:
            self._retire(op_id)
            return
        await running.wait()

    def _retire(self, op_id: str) -> None:
        self._ended[op_id] = None
        self._ended.move_to_end(op_id)
        while len(self._ended) > self._remembered:
            self._ended.popitem(last=False)

    @property
    def running(self) -> int:
        return len(self._running)


MAX_OP_ID_CHARS = 128  # ids are remembered after their op: bound what each one costs


def _check_op_id(op_id: str) -> None:
    if len(op_id) > MAX_OP_ID_CHARS:
        raise PoolError(f"op_id is longer than {MAX_OP_ID_CHARS} characters")
