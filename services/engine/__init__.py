"""The engine: one per accelerator; runs the model and owns the paged KV pool (DESIGN §5).

Public surface (import from the modules; this package stays import-light so that
``services.engine.config`` does not pull in torch):

- ``async_engine.AsyncEngine``: in-process async API (start/stop, generate, abort, status)
- ``api_types``: GenerateRequest, SamplingParams, GenerateOutput, EngineStatus, ModelInfo
- ``errors.EngineError``: typed errors with a code (invalid_argument, not_found, ...)
- ``service.run(config)``: the process (gRPC ``overture.v1.Engine`` + health)

Inside: ``kvcache/`` (device memory in elastic pages over ``device``, the seam; the block
allocator with its prefix cache; per-layer block tables), ``scheduler`` (continuous
batching), ``model_runner`` (ForwardBatch + sampling), ``engine_core`` (the synchronous
step), ``model/`` (the network, loader, tokenizer).

KV kept off the device (DESIGN §3) is behind one boundary, ``offload/``: ``base``
(``Offload``, the points the core calls, and ``NullOffload``), ``kvstore_offload`` (the
worker side: loads, settle or fall back, pinned saves), ``lookup`` (event loop: hash,
peek the device cache, look up, plan), ``planner`` (load or recompute),
``kvstore_client`` (async gRPC client of the node's kvstore), ``layer_readiness``
(per-layer waits of the forward pass), ``jobs`` and ``state`` (the data).
"""
