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
import tempfile
from pathlib import Path

import torch

from bench.engine.speed_report import bandwidth_line, copy_bandwidth, peer_lines, report
from bench.engine.speed_workload import BATCHES, peak_rss_mib

__all__ = ["BATCHES", "main", "measure"]
# Each side runs in a spawned process that imports this module again: the services and
# transformers are imported inside the functions that need them (speed_ours.py,
# speed_hf.py), so that neither side's peak RSS counts the other's code.


def _child(kind: str, model: str, prompt_len: int, gen: int, dtype: str, extras: bool,
           pairs: int, q: mp.Queue) -> None:
    from bench.engine.speed_hf import run_hf
    from bench.engine.speed_ours import run_ours

    torch.manual_seed(0)
    res = (
        asyncio.run(run_ours(model, prompt_len, gen, dtype, extras, pairs))
        if kind == "ours"
        else run_hf(model, prompt_len, gen, dtype)
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
