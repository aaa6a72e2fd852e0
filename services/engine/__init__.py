"""The engine: one per accelerator; runs the model and owns the paged KV pool (DESIGN §5).

Public surface (import from the modules; this package stays import-light so that
``services.engine.config`` does not pull in torch):

- ``async_engine.AsyncEngine``: in-process async API (start/stop, generate, abort, status,
  activate/evict, prefetch)
- ``api_types``: GenerateRequest, SamplingParams, GenerateOutput, EngineStatus, ModelInfo
- ``errors.EngineError``: typed errors with a code (invalid_argument, not_found, ...)
- ``service.run(config)``: the process (gRPC ``overture.v1.Engine`` + health)

Inside, ``AsyncEngine`` is a facade over ``worker/`` (the one thread that owns the core,
fed typed commands), ``model_slot`` (the model served, its weights on the node's ledger,
its core and kvstore link) and ``streams`` (each request's outputs). The core:
``engine_core`` (the synchronous step), ``scheduler`` (continuous batching), ``sequence``
with what it carries (``reuse_plan``, ``offload_state``, ``layer_readiness``),
``live_request``, ``model_runner`` (ForwardBatch + sampling), ``kvcache/`` (device memory
in elastic pages, the block allocator with its prefix cache, per-layer block tables),
``model/`` (the network, loader, tokenizer).

KV kept off the device (DESIGN §3) is behind one boundary, ``offload/`` (its
``__init__`` maps it): ``boundary`` (``Offload``, the points the core calls, and
``NullOffload``), the kvstore's worker side (``kvstore_offload`` over ``loads``, ``saves``
and ``device_prefetch/``), its event-loop side (``kvstore_link``, ``kvstore_client``,
``reuse_planner``, ``prefetch_joins``), and between them ``transport``.
"""
