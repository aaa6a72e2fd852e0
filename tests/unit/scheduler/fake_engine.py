"""A small in-process Engine gRPC servicer for unit tests of the scheduler and node manager.

Each word of the prompt is a token; generation emits ``max_tokens`` tokens named ``t<i>``.
Prompts longer than the context fail with INVALID_ARGUMENT as the real engine does.
"""

from __future__ import annotations

import asyncio

import grpc

from shared.proto import common_pb2, engine_pb2, engine_pb2_grpc


def _logprob(token: str, lp: float | None, top: int) -> common_pb2.TokenLogprob:
    """A made-up entry: the token first among ``top`` alternatives ``alt<j>``."""
    alts = [common_pb2.TopLogprob(token=token, bytes=token.encode(), logprob=lp or 0.0)]
    alts += [common_pb2.TopLogprob(token=f"alt{j}", bytes=f"alt{j}".encode(),
                                   logprob=(lp or 0.0) - j) for j in range(1, top)]
    return common_pb2.TokenLogprob(token=token, bytes=token.encode(), logprob=lp,
                                   top=alts[:top] if lp is not None else [])


def _prompt_logprobs(request: common_pb2.GenerateRequest, prompt: list[int]
                     ) -> list[common_pb2.TokenLogprob]:
    if not request.sampling.HasField("prompt_logprobs"):
        return []
    k = request.sampling.prompt_logprobs
    return [_logprob(f"p{t} ", None if i == 0 else -1.0 * i, k) for i, t in enumerate(prompt)]


class FakeEngine(engine_pb2_grpc.EngineServicer):
    def __init__(
        self, model: str = "demo", max_model_len: int = 64, token_delay_s: float = 0.0
    ) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.token_delay_s = token_delay_s
        self.running = 0
        self.cancelled = 0
        self.requests: list[common_pb2.GenerateRequest] = []
        self.fail_with: grpc.StatusCode | None = None
        # With fail_with: fail only while this count (shareable between engines) is > 0.
        self.fail_budget: list[int] | None = None
        self.kv_from = "recompute"  # what the first chunk says of the prompt's KV
        self.saved: list[common_pb2.SessionSaved] = []  # reported by Status(saved_after)
        self.status_calls: list[int] = []  # the saved_after of each Status call
        self.keepalives = 0  # keepalive messages sent before the first chunk
        self.stall_after: int | None = None  # after this many chunks, hang (a stopped engine)
        self.max_num_seqs = 0  # the seats its model info says (0: not said)
        self.queue_delay_s = 0.0  # reported by Status
        self.waiting = 0  # reported by Status
        self.prefetches: list[engine_pb2.PrefetchRequest] = []  # device prefetch orders
        self.ended: list[engine_pb2.EndPrefetchRequest] = []

    async def Prefetch(self, request, context):
        self.prefetches.append(request)
        return engine_pb2.PrefetchReply(blocks=4)

    async def EndPrefetch(self, request, context):
        self.ended.append(request)
        return engine_pb2.EndPrefetchReply()

    def save(self, tenant: str, session_id: str, tokens: int) -> None:
        """Report a completed session save (as the engine does once the kvstore has it)."""
        seq = len(self.saved) + 1
        self.saved.append(common_pb2.SessionSaved(tenant=tenant, session_id=session_id,
                                                  tokens=tokens, seq=seq))

    def _prompt_ids(self, req: common_pb2.GenerateRequest) -> list[int]:
        if req.input_kind == common_pb2.GenerateRequest.TOKEN_IDS:
            return list(req.prompt_token_ids)
        if req.input_kind == common_pb2.GenerateRequest.CHAT:
            words = [w for m in req.messages for w in (m.role + " " + m.content).split()]
        else:
            words = req.prompt.split()
        return [len(w) for w in words]

    async def Generate(self, request, context):
        self.requests.append(request)
        for _ in range(self.keepalives):  # (before any failure: a quiet start, then an error)
            yield common_pb2.GenerateChunk(request_id=request.request_id, keepalive=True)
        if self.fail_with is not None and (self.fail_budget is None or self.fail_budget[0] > 0):
            if self.fail_budget is not None:
                self.fail_budget[0] -= 1
            await context.abort(self.fail_with, f"fake engine fails with {self.fail_with.name}")
        if request.model != self.model:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model} not served")
        prompt = self._prompt_ids(request)
        if len(prompt) >= self.max_model_len:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt has {len(prompt)} tokens; the context holds {self.max_model_len}",
            )
        budget = self.max_model_len - len(prompt)
        n = min(request.sampling.max_tokens or budget, budget)
        self.running += 1
        sent = 0
        try:
            if self.stall_after == 0:
                await asyncio.sleep(3600)
            yield common_pb2.GenerateChunk(
                request_id=request.request_id,
                prompt_token_ids=prompt,
                prompt_tokens=len(prompt),
                kv_from=self.kv_from,
                prompt_logprobs=_prompt_logprobs(request, prompt),
            )
            for i in range(n):
                sent += 1
                if self.stall_after is not None and sent > self.stall_after:
                    await asyncio.sleep(3600)
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                last = i == n - 1
                yield common_pb2.GenerateChunk(
                    request_id=request.request_id,
                    text=f"t{i} ",
                    token_ids=[i],
                    prompt_tokens=len(prompt),
                    completion_tokens=i + 1,
                    finish_reason="length" if last else "",
                    logprobs=[_logprob(f"t{i} ", -0.5 * (i + 1), request.sampling.logprobs)]
                    if request.sampling.HasField("logprobs") else [],
                )
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1

    async def Status(self, request, context):
        self.status_calls.append(request.saved_after)
        return engine_pb2.EngineStatus(
            saved=[s for s in self.saved if s.seq > request.saved_after],
            models=[
                common_pb2.ModelInfo(
                    name=self.model, max_model_len=self.max_model_len, dtype="float32",
                    max_num_seqs=self.max_num_seqs,
                )
            ],
            running=self.running,
            waiting=self.waiting,
            blocks_total=100,
            blocks_free=100,
            queue_delay_s=self.queue_delay_s,
        )
