"""KV kept off the device, behind one boundary the engine core calls (``base.Offload``).

``NullOffload`` serves device-only and recompute runs; ``kvstore_offload.KVStoreOffload``
is the node's kvstore (worker thread), fed by ``lookup.PrefixLookup`` and
``kvstore_client.KVStoreClient`` on the event loop. ``planner`` decides what to load,
``layer_readiness`` lets the forward pass wait per layer, ``state`` and ``jobs`` are the
data that crosses between them.

This package's modules are imported by name (``services.engine.offload.base`` ...): the
engine's scheduler and sequence import ``state`` and ``planner`` while ``base`` imports
them, so this file stays empty of imports.
"""
