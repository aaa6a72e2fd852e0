"""Advised sessions' KV prefetched into free device blocks (Symphony §3.4, §3.6).

An advisory has the node's kvstore stage a session's KV in DRAM (the kvstore's
``SessionStager``); the engine then copies it into device blocks nobody uses, indexed in
the prefix cache under the same content hashes a request's prompt has (the kvstore's
sequence of the session *is* the prompt's prefix), so the request finds it like any reuse.
Prefetched blocks are a state of their own: used in the allocator, one reference held
here, given up by the engine itself when running requests need memory (cooperative
memory: the engine core wires ``DevicePrefetch`` into its ``BlockAllocator`` as the
allocator's ``Reclaimer``).

    fill (every step):  for layer 0 .. L-1:                  lower layers of every
                          for each advised session lacking it:   advised session before a
                            room (or purge a higher layer,         higher layer of any
                            only if that makes it); else stop      (§3.4)
    purge order:        later layers first across sessions, then the lower priority,
                        then the least recently advised session (§3.4: "later-layer
                        caches are discarded first, followed by ... the least recently
                        used request"); to make room for a prefetch, only higher layers
                        of sessions of no higher priority (or lower-priority sessions)
    room:               free blocks and the plain device cache (least recently used
                        first), beyond what running requests and the head of the queue
                        may need next step; a straight-to-device session (the
                        ``priority`` policy) may also purge lower-priority sessions'
                        prefetched blocks at any layer
    its request came:   the request holds the blocks it uses; the session leaves the book
                        (a session with a request in the engine is not filled)
    expired (§3.6):     unfollowed within its TTL: its blocks go to the front of the
                        device cache's eviction order (the first to purge)
    invalidated:        its blocks are freed at once

A purged layer's copy stays in the kvstore's DRAM: nothing is lost and nothing moves
back; a request that arrives loads the missing upper layers layer-wise from it
(``BlockTables.find_partial_run``). Runs on the engine's worker thread; the event loop
hears of its loads only through a ``LoadWatch`` (``offload/prefetch_joins.py``).

``orders`` holds the data (an advisory's order, its entry in the book), ``purge`` the
order in which prefetched layers are given back, ``prefetch`` the book itself.
"""

from services.engine.offload.device_prefetch.orders import (
    DEVICE_PARTIAL,
    DEVICE_PREFETCHED,
    LAYERS,
    SESSIONS,
    PrefetchOrder,
)
from services.engine.offload.device_prefetch.prefetch import (
    DevicePrefetch,
    LoadWatch,
    RequestDemand,
)

__all__ = [
    "DEVICE_PARTIAL",
    "DEVICE_PREFETCHED",
    "LAYERS",
    "SESSIONS",
    "DevicePrefetch",
    "LoadWatch",
    "PrefetchOrder",
    "RequestDemand",
]
