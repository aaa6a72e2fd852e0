"""The synchronous engine: scheduler + KV + model runner + outputs, driven by ``step()``.

    step:  offload.begin_step ─► scheduler.schedule ─► offload.forward( runner.execute )
           ─► offload.after_forward (failed loads: scheduler.requeue) ─► scheduler.advance
           ─► sample ─► offload.after_sample

KV kept off the device is behind ``self.offload`` (offload/boundary.py), built by the
``OffloadFactory`` the constructor is given over the core's own block tables, scheduler
and pool (``NullOffload`` without one); a load that failed comes back from
``offload.after_forward`` as a request id, which the core requeues to be recomputed. Not
thread-safe by design: exactly one thread (the AsyncEngine's worker) calls it.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass

import torch

from shared.config import ConfigError
from shared.device_ledger import DeviceLedger
from shared.session_key import SessionKey

from .api_types import EngineStatus, GenerateOutput, ModelInfo, TokenLogprob
from .config import EngineConfig
from .errors import RESOURCE_EXHAUSTED, EngineError
from .kvcache.block_allocator import BlockAllocator
from .kvcache.block_tables import BlockTables
from .kvcache.device_memory import DeviceMemory
from .live_request import LiveRequest
from .logits_processors import History
from .model import IncrementalDetokenizer, LoadedModel
from .model_runner import LogitRows, ModelRunner, logit_rows
from .offload import NullOffload, Offload, OffloadFactory, PrefetchOrder
from .output_state import ABORT, OutputState
from .remap import Remapper, lendable_bytes
from .reuse_plan import ReusePlan
from .sampling import log_probs, make_generator, row_logprobs
from .scheduler import Scheduler
from .sequence import Sequence
from .token_text import TokenText
from .validation import PreparedRequest
from .wait_forecast import StepCost

log = logging.getLogger(__name__)

# With a node's shared budget, a request that cannot get pages waits for the nodemgr to
# reclaim them from idle engines, retrying every BUDGET_RETRY_S, for BUDGET_WAIT_S at most.
BUDGET_RETRY_S = 0.05
BUDGET_WAIT_S = 30.0


@dataclass(frozen=True)
class Failure:
    """A request the engine had to give up on; the caller raises ``error`` to its client."""

    request_id: str
    error: EngineError


Event = GenerateOutput | Failure


def context_limit(
    model_max: int, configured: int, pool_blocks: int, num_layers: int, block_size: int
) -> int:
    """The context length: the model's, lowered by config and by what ONE sequence can hold
    in the pool (so a lone request can always run to its end)."""
    limit = model_max if configured == 0 else min(model_max, configured)
    return min(limit, pool_blocks // num_layers * block_size)


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel,
                 ledger: DeviceLedger | None = None, offload: OffloadFactory | None = None
                 ) -> None:
        """``ledger``: the node's shared device budget; ``offload``: builds the boundary to
        KV kept off the device over this core's parts (None: device only)."""
        mc = loaded.config
        self.config = config
        self.loaded = loaded
        lend = lendable_bytes(config.remap, loaded.model)  # MIRAGE: weights lent as KV
        self.pool = DeviceMemory(
            block_size=config.block_size,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype=loaded.dtype,
            budget_bytes=config.device_memory_bytes,
            page_bytes=config.page_bytes,
            device=config.device,
            ledger=ledger,
            reserve_bytes=config.kv_reserve_bytes,
            lendable_bytes=lend,
        )
        self.blocks = BlockAllocator(self.pool)
        self.kv = BlockTables(self.blocks, mc.num_layers, config.block_size)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.offload: Offload = (offload(self.kv, self.scheduler, self.pool)
                                 if offload is not None else NullOffload())
        # Prefetched blocks give way to running requests (cooperative memory): the offload
        # holds them, the allocator asks it when it runs dry.
        self.blocks.set_reclaimer(self.offload.reclaimer)
        self.runner = ModelRunner(
            loaded.model, self.pool.kv_cache, mc.num_layers, config.block_size
        )
        self.remap = Remapper(config.remap, loaded.model, loaded.name, self.pool, self.blocks,
                              self.scheduler.pending_kv_blocks, self.offload.reclaimer
                              ) if lend else None
        self.max_model_len = context_limit(
            mc.max_position_embeddings,
            config.max_model_len,
            self.pool.budget_blocks,
            mc.num_layers,
            config.block_size,
        )
        if self.max_model_len < 2:
            self.pool.close()
            raise ConfigError(
                f"engine.device_memory_bytes: the KV pool ({self.pool.num_blocks} blocks for "
                f"{mc.num_layers} layers) cannot hold one sequence; raise it"
            )
        self.debug_checks = config.debug_checks
        self.spelling = TokenText(loaded.tokenizer)  # tokens as log-probabilities show them
        self._live: dict[str, LiveRequest] = {}
        # Nothing can run until the kvstore gives pinned/parked blocks back: idle until then
        # (an unpin, a new request or an abort clears it) instead of spinning.
        self._stalled = False
        # The node's other engines hold its shared budget (device ledger): retry at this
        # monotonic time, after the broker had a chance to reclaim pages (0.0: not waiting).
        self.budget_retry_at = 0.0
        self.steps = 0  # calls of step(), scheduled or not
        # Measured step costs and output lengths: admission's forecast of a queue's wait.
        # (No prior: a guess would refuse a burst on an engine that never ran; the first
        # steps measure the costs, and the queue's age bounds the wait until then.)
        self.step_cost = StepCost()
        self._arrivals = itertools.count()
        self._seeds = random.Random(config.seed)
        self.model_info = ModelInfo(
            name=loaded.name,
            fingerprint=loaded.fingerprint,
            max_model_len=self.max_model_len,
            dtype=str(loaded.dtype).removeprefix("torch."),
            num_layers=mc.num_layers,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
        )

    # ---- requests -----------------------------------------------------------------------
    def add(self, req: PreparedRequest, plan: ReusePlan | None = None) -> None:
        """Queue a request; ``plan`` says which stored prefix to load at admission."""
        self._stalled = False
        self.budget_retry_at = 0.0
        mc = self.loaded.config
        seed = req.sampling.seed if req.sampling.seed is not None else self._seeds.getrandbits(63)
        seq = Sequence(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=req.sampling,
            hash_seed=req.hash_seed,
            max_total_tokens=len(req.prompt_token_ids) + req.max_output_tokens,
            arrival=next(self._arrivals),
            num_layers=mc.num_layers,
            priority=req.priority,
            tenant=req.tenant,
            session_id=req.session_id,
            no_reuse=req.no_reuse,
            device_only=req.device_only,
            cache_retention_s=req.cache_retention_s,
        )
        seq.offload.plan = self.offload.accept(plan)
        detok = IncrementalDetokenizer(self.loaded.tokenizer, req.prompt_token_ids)
        out = OutputState(detok, req.sampling, mc.eos_token_ids, req.max_output_tokens)
        self._live[req.request_id] = LiveRequest(seq, out, make_generator(seed),
                                                 constraint=req.constraint,
                                                 tool_stream=req.tool_stream)
        self.scheduler.add(seq)

    def prefetch(self, order: PrefetchOrder) -> None:
        """Prefetch an advised session's stored KV into free device blocks."""
        self._stalled = False
        self.offload.add_prefetch(order)

    def end_prefetch(self, session: SessionKey, expired: bool = False) -> bool:
        """An advisory ended unfollowed: free its prefetched blocks (``expired``: make them
        the first to purge); whether it had any."""
        self._stalled = False
        return self.offload.end_prefetch(session, expired)

    def abort(self, request_id: str) -> GenerateOutput | None:
        self._stalled = False
        live = self._live.pop(request_id, None)
        if live is None:
            return None
        self.offload.dropped(live.seq)
        self.scheduler.finish(live.seq)
        live.output_state.finish(ABORT)
        return live.output([])

    def abort_all(self) -> list[GenerateOutput]:
        return [o for rid in list(self._live) if (o := self.abort(rid)) is not None]

    def has_work(self) -> bool:
        # (a wait for the node's budget holds back only an engine with nothing running)
        return (self.scheduler.has_work() and not self._stalled
                and (bool(self.scheduler.running) or time.monotonic() >= self.budget_retry_at)
                ) or self.offload.fill_pending()  # purged advised layers fit again

    def unpin(self, job_id: int, ok: bool = True) -> None:
        """A save was answered (``ok``: it stored its chunks): its blocks are let go."""
        self._stalled = False
        self.offload.unpin(job_id, ok)

    def load_ended(self) -> None:
        """A load RPC ended: blocks parked behind a failed load may be free now."""
        self._stalled = False

    def kvstore_attached(self, blocks_per_chunk: int) -> None:
        """The pool is attached to the node's kvstore, whose chunks are this many blocks
        (where mid-generation saves cut)."""
        self.offload.attached(blocks_per_chunk)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[Event]:
        self.offload.begin_step()
        self.steps += 1
        if self.remap is not None:
            self.remap.before_step()  # MIRAGE Algorithm 1: lend or take back weight memory
        out = self.scheduler.schedule()
        if out.empty:
            return self._fail_unservable()
        self.budget_retry_at = 0.0  # the queue moves: no wait for the node's budget
        lr = logit_rows(out)
        rows = {s.request_id: lr.last[i] for i, s in enumerate(out.sequences)}  # logits rows
        decodes = sum(1 for n in out.num_scheduled_tokens.values() if n == 1)
        prefills = out.total_tokens - decodes
        started = time.perf_counter()
        with self.offload.forward(out) as wait_for_layer:
            logits = self.runner.execute(out, wait_for_layer)  # (num_seqs, vocab)
        for rid in self.offload.after_forward(out, time.perf_counter() - started):
            self.scheduler.requeue(self._live[rid].seq, out)  # its load failed: recompute
        due = self.scheduler.advance(out)
        if lr.prompt:
            self._prompt_logprobs(logits, lr)
        events = self._sample(logits, [rows[s.request_id] for s in due], due)
        self.offload.after_sample([s for s in due if s.request_id in self._live])
        if not out.loads:  # (a step that waited for loaded layers says nothing of compute)
            self.step_cost.observe(decodes, prefills, time.perf_counter() - started)
        if self.remap is not None:
            self.remap.after_forward(time.perf_counter() - started)
            if not self.scheduler.has_work():
                self.remap.settle()  # the burst is over: give back what its KV no longer uses
        if self.debug_checks:
            self.check_integrity()
        return events

    def _sample(self, logits: torch.Tensor, rows: list[int], due: list[Sequence]
                ) -> list[Event]:
        if not due:
            return []
        lives = [self._live[s.request_id] for s in due]
        width = logits.shape[-1]
        masks = [lv.constraint.allowed(width) if lv.constraint else None for lv in lives]
        histories = [History(s.token_ids, s.num_prompt_tokens, self._banned(s), lv.tally)
                     for s, lv in zip(due, lives, strict=True)]
        got = self.runner.sample(logits, rows, due, [lv.generator for lv in lives], masks,
                                 histories)
        return [self._append(lv, t, self.spelling.token(lp) if lp is not None else None)
                for lv, t, lp in zip(lives, got.tokens, got.logprobs, strict=True)]

    def _banned(self, s: Sequence) -> tuple[int, ...]:
        """What ``min_tokens`` holds back from ``s`` now."""
        p = s.sampling
        if s.num_output_tokens >= p.min_tokens:
            return ()
        eos = () if p.ignore_eos else tuple(self.loaded.config.eos_token_ids)
        return eos + p.stop_token_ids

    def _prompt_logprobs(self, logits: torch.Tensor, lr: LogitRows) -> None:
        """The prompt positions this step computed, for the requests that asked (echo): the
        raw model's distribution (no processor has a history to act on in a prompt)."""
        for rid, (first, row, n) in lr.prompt.items():
            live = self._live.get(rid)
            if live is None:
                continue
            k = live.seq.sampling.prompt_logprobs
            lp = log_probs(logits[row:row + n].float().cpu(), torch.zeros(n))  # (n, V)
            ids = live.seq.prompt_token_ids
            live.add_prompt_logprobs(first + 1, [
                self.spelling.token(row_logprobs(lp[j], ids[first + 1 + j], k))
                for j in range(n)], self.spelling.spell(ids[0]))

    def _append(self, live: LiveRequest, token: int, lp: TokenLogprob | None
                ) -> GenerateOutput:
        live.add_token(token)
        if live.finished:
            seq = live.seq
            self.step_cost.finished(seq.num_output_tokens)
            self.offload.finished(seq)
            self.scheduler.finish(seq)
            del self._live[seq.request_id]
        return live.output([token], (lp,) if lp is not None else ())

    def _fail_unservable(self) -> list[Event]:
        """Nothing could be scheduled: if nothing runs either, the head of the queue can
        never get its blocks (the pool memory could not be committed); fail it."""
        # A retry time is set only while a wait for the node's budget is under way: one
        # left from an earlier wait would wake the worker loop at once, for ever (a spin
        # that took the node's core from the engines with work).
        self.budget_retry_at = 0.0
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        if self.offload.holds_blocks:
            self._stalled = True
            return []  # blocks come back when the kvstore answers
        seq = self.scheduler.waiting[0]
        if self.pool.shares_budget and time.monotonic() - seq.waiting_since < BUDGET_WAIT_S:
            # Other engines of the node hold the budget: the broker reclaims idle ones'.
            self.budget_retry_at = time.monotonic() + BUDGET_RETRY_S
            return []
        self._live.pop(seq.request_id, None)
        self.offload.dropped(seq)
        self.scheduler.finish(seq)
        log.warning("request %s cannot get KV blocks with nothing running", seq.request_id)
        return [
            Failure(
                seq.request_id,
                EngineError(
                    RESOURCE_EXHAUSTED,
                    "the KV pool cannot hold this request now (device memory "
                    "could not be committed); retry later or raise engine.device_memory_bytes",
                ),
            )
        ]

    # ---- memory and status --------------------------------------------------------------
    def shrink(self, max_pages: int) -> int:
        """Release up to ``max_pages`` pages of KV memory that hold no running KV, keeping
        the pool's reserve (pages below it would be held back for this engine anyway: the
        others could not have them, and its prefix cache would be lost for nothing)."""
        spare = self.pool.num_committed_pages - self.pool.reserve_pages
        return self.blocks.shrink(min(max_pages, spare)) if spare > 0 else 0

    def status(self) -> EngineStatus:
        b = self.blocks
        return EngineStatus(
            models=(self.model_info,),
            blocks_total=self.pool.page_limit * self.pool.blocks_per_page,  # (+ lent pages)
            blocks_free=b.num_free + self.pool.num_uncommitted_blocks,
            blocks_used=b.num_used,
            blocks_evictable=b.num_evictable,
            blocks_committed=b.num_committed,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            device_budget_bytes=self.pool.kv_budget_bytes,
            block_bytes=self.pool.block_bytes,
            device=self.config.device,
            pool_name=self.pool.name,
            preemptions=self.scheduler.num_preemptions,
            oldest_waiting_since=self.scheduler.oldest_waiting_since(),
            admitted=self.scheduler.num_admitted,
            reuse=self.offload.stats(),
            queue=self.scheduler.queue_shape(self.step_cost),
            remap=self.remap.stats() if self.remap is not None else None,
        )

    def drop_cached(self) -> int:
        """Evict every evictable block from the device prefix cache; how many."""
        return len(self.blocks.evict(self.blocks.num_evictable))

    def check_integrity(self) -> None:
        self.blocks.check_integrity()
        held: dict[int, int] = {}
        for live in self._live.values():
            live.seq.check()
            for table in live.seq.block_tables:
                for blk in table:
                    held[blk] = held.get(blk, 0) + 1
        for blk in self.offload.held_blocks():
            held[blk] = held.get(blk, 0) + 1
        for blk, n in held.items():
            assert self.blocks.refcount[blk] == n, f"block {blk}: refcount != holders {n}"
        assert self.blocks.num_used == len(held), "used blocks not held by any sequence"

    def close(self) -> None:
        if self.remap is not None:
            self.remap.close()
        self.pool.close()

