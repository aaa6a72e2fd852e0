"""The engine: one per accelerator; runs the model and owns the paged KV pool (DESIGN §5).

Public surface (import from the modules; this package stays import-light so that
``services.engine.config`` does not pull in torch):

- ``async_engine.AsyncEngine``: in-process async API (start/stop, generate, abort, status)
- ``api_types``: GenerateRequest, SamplingParams, GenerateOutput, EngineStatus, ModelInfo
- ``errors.EngineError``: typed errors with a code (invalid_argument, not_found, ...)
- ``service.run(config)``: the process (gRPC ``overture.v1.Engine`` + health)

Inside: ``kv_pool`` (shared-memory pool, elastic pages) over ``device`` (the device seam),
``block_pool`` (allocator + prefix cache), ``kv_manager`` (per-layer block tables),
``scheduler`` (continuous batching), ``model_runner`` (ForwardBatch + sampling),
``engine_core`` (the synchronous step), ``model/`` (the network, loader, tokenizer).

KV reuse with the node's kvstore (issue 5, DESIGN §3): ``kv_connector`` (async gRPC client:
AttachPool, LookupPrefix, LoadIntoPool, SaveFromPool, ReleaseLease), ``reuse_coordinator``
(event loop: hash, peek the device cache, look up, plan), ``reuse_planner`` (load or
recompute), ``kv_reuse`` (worker: start loads, settle or fall back, pin saves),
``layer_readiness`` (per-layer waits of the forward pass), ``kv_transfer`` (the jobs).
"""
