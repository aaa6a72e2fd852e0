"""Engine speed vs Hugging Face transformers on the same weights, in the same run.

    python -m bench.engine.speed [--size small|tiny] [--model DIR|FILE.gguf|NAME] [--quick]
                                 [--dtype float32|bfloat16|q8_0|q4]
                                 [--peer llama.cpp [--llama-cpp-bin DIR] [--peer-gguf FILE]]

For batch sizes 1, 8 and 32: B distinct random prompts of P tokens, G greedy tokens each.

- ours: all B requests submitted at once to the in-process AsyncEngine; prefill tokens/s
  = B*P / time until every request has its first token; decode tokens/s = B*(G-1) / the
  rest of the time.
- transformers: ``LlamaForCausalLM.from_pretrained`` on the same folder, ``generate()``
  greedy on a left-padded batch; a streamer notes when the first new token arrives
  (prefill done) and when the last does (decode done).

Each side runs in its own process so the peak RSS (getrusage high-water) is its own; ours
is also set against its weights' bytes plus the KV pool's committed bytes (issue 44's goal:
peak RSS <= 1.3x that).
Goals (issue 3): batch-1 decode >= 1.0x transformers; ours at 32 concurrent >= 4x ours at 1.
With a quantized dtype (q8_0, q4) transformers cannot run the folder and is skipped.

``--peer llama.cpp`` (issue 44, bench/engine/peer.py) also runs ``llama-bench`` and
``llama-batched-bench`` on the GGUF file (the --model file, or --peer-gguf) with the same
threads: prefill of P tokens and batch-1 decode, and the aggregate decode of 32 parallel
sequences, as ratios ours / llama.cpp. Without the binaries it says so and runs the rest.

Weight bytes read per decoded token at batch 1 are set against the host's memory bandwidth
(a large copy timed in the parent process, so neither side's peak RSS counts it).

The batch-1 decode step's fast path (issue 44, services/engine/model/decode_step.py): the
same prompt decoded with it on and off in ``--decode-pairs`` interleaved pairs, reported as
the mean ratio with its 95% interval.

Constrained decoding (issue 25): decode tokens/s of a batch of 8 whose output must follow
a JSON schema (a long array of short strings, so no sequence can end early) against the
same batch unconstrained, both greedy, in the same engine. Goal: it costs <= 10%.

Log-probabilities and penalties (issue 45): decode tokens/s of a batch of 8 with
``logprobs`` 5 (top 5) and presence, frequency and repetition penalties and a logit bias,
against the same batch plain, interleaved, repeated (the spread is reported). Goal: <= 10%.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import queue
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.eval.stats import goal_at_most, mean_interval, paired_ratio

BATCHES = (1, 8, 32)
# Each side runs in a spawned process that imports this module again: the services and
# transformers are imported inside the functions that need them, so that neither side's
# peak RSS counts the other's code.


def prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + batch)
    # Skip the lowest ids (special tokens) so no prompt contains an EOS or BOS.
    return torch.randint(16, vocab, (batch, prompt_len), generator=g).tolist()


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# ---- ours ---------------------------------------------------------------------------------
# No sequence can finish before ``gen`` tokens: at least 400 strings to write.
LONG_SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 400}


async def _ours_batch(engine, batch: list[list[int]], gen: int,
                      schema: dict | None = None, processed: bool = False
                      ) -> tuple[float, float]:
    from services.engine.api_types import GenerateRequest, Guidance, SamplingParams

    sp = SamplingParams(max_tokens=gen, ignore_eos=True)
    if processed:
        sp = SamplingParams(max_tokens=gen, ignore_eos=True, **PROCESSED)
    guide = Guidance(response_format="json_schema", json_schema=schema) if schema else Guidance()
    firsts: list[float] = []
    counts: list[int] = []

    async def one(ids: list[int]) -> None:
        got_first = False
        n = 0
        req = GenerateRequest(prompt_token_ids=tuple(ids), sampling=sp, guidance=guide)
        async for out in engine.generate(req):
            n += len(out.token_ids)
            if not got_first:
                firsts.append(time.perf_counter())
                got_first = True
        counts.append(n)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(ids) for ids in batch))
    t_end = time.perf_counter()
    t_first = max(firsts)
    assert all(n == gen for n in counts), f"a sequence ended early: {counts}"
    return t_first - t0, t_end - t_first


async def _constrained(eng, prompt_len: int, gen: int, vocab: int) -> tuple[float, float]:
    """Decode tok/s of a batch of 8: unconstrained, then with LONG_SCHEMA (best of 2)."""
    batch = prompts(8, prompt_len, vocab, seed=7)
    free, guided = 0.0, 0.0
    for _ in range(2):
        _, t = await _ours_batch(eng, batch, gen)
        free = max(free, 8 * (gen - 1) / t)
        _, t = await _ours_batch(eng, batch, gen, LONG_SCHEMA)
        guided = max(guided, 8 * (gen - 1) / t)
    return free, guided


PROCESSED = {"logprobs": 5, "presence_penalty": 0.5, "frequency_penalty": 0.5,
             "repetition_penalty": 1.1, "logit_bias": ((20, 1.0), (21, -1.0))}
REPEATS = 20  # interleaved pairs: single pairs on a 2-core host vary by ±20%


async def _processed(eng, prompt_len: int, gen: int, vocab: int) -> list[float]:
    """Decode cost of PROCESSED on a batch of 8, per interleaved pair (plain first, then
    processed, the same prompts): 1 - processed tok/s / plain tok/s."""
    batch = prompts(8, prompt_len, vocab, seed=11)
    costs = []
    for _ in range(REPEATS):
        _, t_plain = await _ours_batch(eng, batch, gen)
        _, t_done = await _ours_batch(eng, batch, gen, processed=True)
        costs.append(1 - t_plain / t_done)  # 1 - (tok/s processed) / (tok/s plain)
    return costs


async def _fast_decode_pairs(eng, prompt_len: int, gen: int, vocab: int,
                             pairs: int) -> tuple[list[float], list[float]]:
    """Batch-1 decode tok/s with the all-decode fast path (model/decode_step.py) and with
    the general path, in ``pairs`` interleaved pairs on the same prompt (issue 44)."""
    model = eng.loaded.model
    batch = prompts(1, prompt_len, vocab, seed=13)
    fast: list[float] = []
    general: list[float] = []
    for _ in range(pairs):
        for on, into in ((True, fast), (False, general)):
            model.fast_decode = on  # (between requests: the worker thread is idle)
            _, t = await _ours_batch(eng, batch, gen)
            into.append((gen - 1) / t)
    model.fast_decode = True
    return fast, general


async def _ours(model: str, prompt_len: int, gen: int, dtype: str, extras: bool,
                pairs: int = 0) -> dict:
    from services.engine.async_engine import AsyncEngine
    from services.engine.config import EngineConfig

    cfg = EngineConfig(
        model_path=model,
        dtype=dtype,
        device_memory_bytes=2 << 30,
        max_num_seqs=64,
        max_num_batched_tokens=max(BATCHES) * prompt_len,
        max_queue_delay_s=0.0,  # a closed batch: measure the steps, not the admission
    )
    from services.engine.model_slot import weight_bytes

    out: dict = {}
    async with AsyncEngine(cfg) as eng:
        assert eng.loaded is not None
        vocab = eng.loaded.config.vocab_size
        out["weights"] = weight_bytes(eng.loaded.model)
        kv = 0  # the KV pool's committed bytes, its high-water over the runs
        await _ours_batch(eng, prompts(1, prompt_len, vocab, seed=99), 4)  # warm-up
        for b in BATCHES:
            # Fresh prompts per batch size, and the prefix cache cannot help: ids differ.
            t_pre, t_dec = await _ours_batch(eng, prompts(b, prompt_len, vocab), gen)
            out[b] = (b * prompt_len / t_pre, b * (gen - 1) / t_dec)
            st = await eng.status()
            kv = max(kv, st.blocks_committed * st.block_bytes)
        out["kv"] = kv
        if pairs:
            out["fast_decode"] = await _fast_decode_pairs(eng, prompt_len, gen, vocab, pairs)
        if extras:
            out["constrained"] = await _constrained(eng, prompt_len, gen, vocab)
            out["processed"] = await _processed(eng, prompt_len, gen, vocab)
    return out


# ---- transformers -------------------------------------------------------------------------
class _Clock:
    """A generate() streamer that only notes when tokens arrive: the first put() is the
    prompt, the second the first new token (prefill done), the last the final token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _hf(model: str, prompt_len: int, gen: int, dtype: str) -> dict:
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    vocab = m.config.vocab_size

    def run(batch: list[list[int]], new: int) -> tuple[float, float]:
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, p in enumerate(batch):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        clock = _Clock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            m.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                streamer=clock,
            )
        return clock.times[1] - t0, clock.times[-1] - clock.times[1]

    run(prompts(1, prompt_len, vocab, seed=99), 4)  # warm-up
    out = {}
    for b in BATCHES:
        t_pre, t_dec = run(prompts(b, prompt_len, vocab), gen)
        out[b] = (b * prompt_len / t_pre, b * (gen - 1) / t_dec)
    return out


# ---- process plumbing and report ----------------------------------------------------------
def _child(kind: str, model: str, prompt_len: int, gen: int, dtype: str, extras: bool,
           pairs: int, q: mp.Queue) -> None:
    torch.manual_seed(0)
    res = (
        asyncio.run(_ours(model, prompt_len, gen, dtype, extras, pairs))
        if kind == "ours"
        else _hf(model, prompt_len, gen, dtype)
    )
    q.put((res, peak_rss_mib()))


def measure(kind: str, model: str, prompt_len: int, gen: int, dtype: str,
            extras: bool = True, pairs: int = 0) -> tuple[dict, float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(kind, model, prompt_len, gen, dtype, extras, pairs,
                                         q))
    p.start()
    while True:  # a child that dies puts nothing: say so instead of waiting forever
        try:
            res = q.get(timeout=5.0)
            break
        except queue.Empty:
            if not p.is_alive():
                raise RuntimeError(f"the {kind} side exited with code {p.exitcode} "
                                   "before its result (its traceback is above)") from None
    p.join()
    return res


def copy_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """The host's memory bandwidth as this process sees it, bytes/s: the best of
    ``repeats`` copies of a ``mib`` MiB buffer, counting the bytes read and written."""
    src = torch.ones(mib << 18)  # float32: mib MiB
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * src.element_size() / best


def bandwidth_line(ours: dict, bandwidth: float) -> str:
    """Weight bytes read per decoded token at batch 1 against the measured bandwidth."""
    per_s = ours["weights"] * ours[1][1]
    return (f"weights read at batch-1 decode: {ours['weights'] / 2**20:.0f} MiB a token x "
            f"{ours[1][1]:.1f} tok/s = {per_s / 1e9:.1f} GB/s, {per_s / bandwidth:.0%} of the "
            f"{bandwidth / 1e9:.1f} GB/s this host copies at")


def peer_lines(ours: dict, peer: object, prompt_len: int) -> list[str]:
    """Ratios ours / llama.cpp (``peer`` a bench.engine.peer.PeerResult)."""
    from bench.engine.peer import PeerResult

    assert isinstance(peer, PeerResult)
    pp = peer.prefill.get(prompt_len, 0.0)
    b32 = peer.batched.get(32, 0.0)
    ratios = [("prefill", ours[1][0], pp, 1.0), ("batch-1 decode", ours[1][1], peer.decode1, 1.0),
              ("32-stream decode", ours[32][1], b32, 1.5)]
    out = []
    for what, o, p, goal in ratios:
        r = o / p if p else float("nan")
        out.append(f"llama.cpp {what}: ours {o:.1f} tok/s, llama.cpp {p:.1f} tok/s, {r:.2f}x "
                   f"(goal >= {goal}x: {'MET' if r >= goal else 'NOT MET'})")
    return out


def report(
    ours: dict, hf: dict | None, rss: tuple[float, float], prompt_len: int, gen: int,
    dtype: str,
) -> str:
    lines = [
        (
            f"prompt {prompt_len} tokens, {gen} generated, greedy, {dtype}, "
            f"{torch.get_num_threads()} threads"
        ),
        (
            f"{'batch':>5} | {'prefill tok/s ours':>18} {'hf':>9} {'ratio':>6} | "
            f"{'decode tok/s ours':>17} {'hf':>9} {'ratio':>6}"
        ),
    ]
    nan = (float("nan"), float("nan"))
    for b in BATCHES:
        (op, od), (hp, hd) = ours[b], (hf[b] if hf else nan)
        lines.append(
            f"{b:>5} | {op:>18.1f} {hp:>9.1f} {op / hp:>5.2f}x | "
            f"{od:>17.1f} {hd:>9.1f} {od / hd:>5.2f}x"
        )
    lines.append(f"peak RSS: ours {rss[0]:.0f} MiB, transformers {rss[1]:.0f} MiB")
    held = (ours["weights"] + ours["kv"]) / 2**20
    ratio = rss[0] / held
    lines.append(f"memory: weights {ours['weights'] / 2**20:.0f} MiB + KV pool "
                 f"{ours['kv'] / 2**20:.0f} MiB = {held:.0f} MiB; peak RSS / that {ratio:.2f}x "
                 f"(goal <= 1.3x: {'MET' if ratio <= 1.3 else 'NOT MET'})")
    scale = ours[32][1] / ours[1][1]
    if hf:
        r1 = ours[1][1] / hf[1][1]
        lines.append(f"goal batch-1 decode >= 1.0x transformers: {r1:.2f}x "
                     f"{'MET' if r1 >= 1.0 else 'NOT MET'}")
    else:
        lines.append(f"transformers: not run ({dtype} weights are int4/int8)")
    lines.append(
        f"goal decode at 32 concurrent >= 4x ours at 1: {scale:.2f}x "
        f"{'MET' if scale >= 4.0 else 'NOT MET'}"
    )
    if "fast_decode" in ours:
        fast, general = ours["fast_decode"]
        r = paired_ratio(fast, general)
        lines.append(
            f"batch-1 decode, all-decode fast path vs general path: "
            f"{statistics.fmean(fast):.1f} vs {statistics.fmean(general):.1f} tok/s, "
            f"{r.fmt(1, 3, 'x')} (mean ratio, 95% interval, {r.n} interleaved pairs)")
    if "constrained" not in ours:
        lines.append("constrained decoding and log-probabilities: not run (--no-extras)")
        return "\n".join(lines)
    free, guided = ours["constrained"]
    cost = 1 - guided / free
    lines.append(
        f"batch 8 decode: {free:.1f} tok/s free, {guided:.1f} tok/s with a json_schema; "
        f"goal constrained costs <= 10%: {cost:.1%} {'MET' if cost <= 0.10 else 'NOT MET'}"
    )
    cost_i = mean_interval(ours["processed"])
    lines.append(
        f"batch 8 decode with top_logprobs 5 + penalties + logit_bias vs plain: cost "
        f"{cost_i.fmt(100, 1, '%')} (mean, 95% interval, {cost_i.n} interleaved pairs); "
        f"goal <= 10%: {goal_at_most(cost_i, 0.10)}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=("tiny", "small"))
    ap.add_argument("--model", default="",
                    help="a model folder, a .gguf file or a packaged model's name "
                    "(smollm2-135m-instruct); default: write the demo model")
    ap.add_argument("--quick", action="store_true", help="short prompts and generations")
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32", "q8_0", "q4"),
        help="weights, activations and KV dtype for both sides (q8_0/q4: int8/int4 weights)",
    )
    ap.add_argument("--peer", default="", choices=("", "llama.cpp"),
                    help="also run llama.cpp's benches on the same GGUF and threads")
    ap.add_argument("--llama-cpp-bin", default="",
                    help="folder with llama-bench and llama-batched-bench "
                    "[default: $OVERTURE_LLAMA_CPP_BIN]")
    ap.add_argument("--peer-gguf", default="",
                    help="the GGUF llama.cpp runs [default: the --model file or package]")
    ap.add_argument("--no-extras", action="store_true",
                    help="skip the constrained-decoding and log-probability runs")
    ap.add_argument("--decode-pairs", type=int, default=-1,
                    help="interleaved pairs of batch-1 decode with the all-decode fast path "
                    "on and off (0: none) [default: 10, --quick 2]")
    ap.add_argument("--prompt-len", type=int, default=0)
    ap.add_argument("--gen", type=int, default=0)
    args = ap.parse_args(argv)
    prompt_len = args.prompt_len or (32 if args.quick else 128)
    gen = args.gen or (8 if args.quick else 32)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model:
            from services.models.commands import model_folder

            model = str(model_folder(model, args.dtype, Path(".overture/models")))
        else:
            from services.engine.model import write_demo_model

            model = str(write_demo_model(Path(tmp) / f"demo-{args.size}", size=args.size))
        pairs = args.decode_pairs if args.decode_pairs >= 0 else (2 if args.quick else 10)
        ours, rss_ours = measure("ours", model, prompt_len, gen, args.dtype,
                                 not args.no_extras, pairs)
        hf, rss_hf = (None, float("nan")) if args.dtype in ("q8_0", "q4") else measure(
            "hf", model, prompt_len, gen, args.dtype)
    lines = [report(ours, hf, (rss_ours, rss_hf), prompt_len, gen, args.dtype),
             bandwidth_line(ours, copy_bandwidth(64 if args.quick else 256))]
    if args.peer:
        lines += _peer(args, prompt_len, gen, ours)
    print("\n".join(lines))


def _peer(args: argparse.Namespace, prompt_len: int, gen: int, ours: dict) -> list[str]:
    from bench.engine.peer import find_bin, run_peer

    folder, why = find_bin(args.llama_cpp_bin)
    gguf = args.peer_gguf or (args.model if args.model.lower().endswith(".gguf") else "")
    if not gguf and args.model:
        from services.models.catalog import PACKAGED, locate

        gguf = str(locate(args.model)) if args.model in PACKAGED else ""
    if folder is None:
        return [f"llama.cpp: not run: {why}"]
    if not gguf:
        return ["llama.cpp: not run: no GGUF file (pass --peer-gguf or a .gguf --model)"]
    peer = run_peer(folder, Path(gguf), torch.get_num_threads(), [prompt_len], gen, [1, 32])
    return [f"llama.cpp on {Path(gguf).name}, {torch.get_num_threads()} threads",
            *peer.notes, *peer_lines(ours, peer, prompt_len)]


if __name__ == "__main__":
    main()
