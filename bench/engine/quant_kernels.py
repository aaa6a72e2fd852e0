"""Weight-only int4/int8 GEMM kernels against float32 on SmolLM2-135M's linear shapes.

    python -m bench.engine.quant_kernels [--rows 1 32] [--repeat 5] [--threads 1]
                                         [--clock cpu|wall] [--quick]

For each shape (out, in) of SmolLM2 (fused q/k/v, o, fused gate/up, down, the tied head)
and each row count, the time of one call of:

- ``f32``: float32 ``F.linear`` (MKL), the baseline in the same run;
- ``f32-onednn``: float32 through oneDNN with the weight packed once (the engine's path);
- ``int4-g32``: ``aten._weight_int4pack_mm_for_cpu``, groups of 32 (Q4_0/Q4_1/Q4_K exactly);
  ``int4-g32-bf16`` the same with bfloat16 activations, ``bf16`` a bfloat16 ``F.linear``;
- ``int8-row``: ``aten._weight_int8pack_mm``, a scale per output row (Q8_0/Q6_K re-rounded);
  ``int8-row-bf16`` the same with bfloat16 activations (the weight-only head's kernel);
- ``int8-dyn``: the same int8 weights with int8 activations, a scale per input row, through
  oneDNN (quant/int8_dynamic.py; where the CPU has VNNI or AMX);
- ``fbgemm-dyn``: ``quantized.linear_dynamic`` (fbgemm), one activation scale for the whole
  input: faster still at one row, but a row's result then depends on the rows beside it,
  so the engine cannot use it (reused KV must equal recomputed KV);
- ``int8-g32-loop``: Q8_0 exactly, one int8 GEMM per group of 32 columns with its scales
  applied to the partial sums (the "per-group int8 path");
- ``int8-g32-deq``: Q8_0 exactly, the weight dequantized to float32 on every call.

Variants are interleaved per repeat; the median of ``--repeat`` runs (each the mean of a
batch of calls) is printed, with the spread (min-max), and the ratio to ``f32``.
Also prints the bytes each variant reads per call. ``--clock cpu`` (the default) times
the calling thread's CPU time with one intra-op thread: on a shared, loaded host wall time
mostly measures the wait for a core, CPU time the kernel's own cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

# (name, out, in): SmolLM2-135M (hidden 576, 9 heads x 64, 3 kv heads, intermediate 1536)
SHAPES = (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
          ("head", 49152, 576))


def _variants(n: int, k: int) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]]:
    """name -> (call on x, weight bytes read)."""
    from services.engine.model.linear import float32_linear, pack_float32
    from services.engine.model.quant import (
        Int4Linear,
        Int8DynamicLinear,
        Int8Linear,
        dynamic_int8_supported,
        quantize_int4,
        quantize_int8,
    )

    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.05
    packed = pack_float32(w)
    q4 = Int4Linear(quantize_int4(w), None)
    q4b = Int4Linear(quantize_int4(w), None, torch.bfloat16)
    wb = w.to(torch.bfloat16)
    q8 = quantize_int8(w)
    i8 = Int8Linear(q8.codes, q8.scale[:, 0], None)
    i8b = Int8Linear(q8.codes, q8.scale[:, 0], None, torch.bfloat16)
    groups = k // 32
    codes = (torch.randint(-127, 128, (n, k), generator=g)).to(torch.int8)
    gscale = torch.rand(n, groups, generator=g) * 1e-3
    # per-group loop: G int8 GEMMs with unit scales, partial sums scaled and added
    chunks = [codes[:, i * 32:(i + 1) * 32].contiguous() for i in range(groups)]
    ones = torch.ones(n)
    gs_t = gscale.t().contiguous()  # (groups, out)

    def loop(x: torch.Tensor) -> torch.Tensor:
        y = torch.zeros(x.shape[0], n)
        for i, c in enumerate(chunks):
            y += torch.ops.aten._weight_int8pack_mm(x[:, i * 32:(i + 1) * 32].contiguous(), c,
                                                    ones) * gs_t[i]
        return y

    def deq(x: torch.Tensor) -> torch.Tensor:
        wf = (codes.view(n, groups, 32).float() * gscale[..., None]).view(n, k)
        return F.linear(x, wf)

    out: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]] = {
        "f32": (lambda x: F.linear(x, w), n * k * 4),
        "int4-g32": (q4, q4.weight_bytes),
        "int4-g32-bf16": (lambda x: q4b(x.to(torch.bfloat16)), q4b.weight_bytes),
        "bf16": (lambda x: F.linear(x.to(torch.bfloat16), wb), n * k * 2),
        "int8-row": (i8, i8.weight_bytes),
        "int8-row-bf16": (lambda x: i8b(x.to(torch.bfloat16)), i8b.weight_bytes),
        "int8-g32-loop": (loop, n * k + n * groups * 4),
        "int8-g32-deq": (deq, n * k + n * groups * 4),
    }
    if packed is not None:
        out["f32-onednn"] = (lambda x: float32_linear(x, packed, None), n * k * 4)
    if dynamic_int8_supported():
        dyn = Int8DynamicLinear(i8)
        out["int8-dyn"] = (dyn, dyn.weight_bytes)
    try:
        qw = torch.quantize_per_channel(q8.dequantize(), q8.scale[:, 0].double(),
                                        torch.zeros(n, dtype=torch.long), 0, torch.qint8)
        fb = torch.ops.quantized.linear_prepack(qw, None)
        out["fbgemm-dyn"] = (lambda x: torch.ops.quantized.linear_dynamic(x, fb, False),
                             i8.weight_bytes)
    except (RuntimeError, AttributeError):  # a build without fbgemm
        pass
    return out


def _time(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, calls: int,
          clock: Callable[[], float]) -> float:
    with torch.inference_mode():
        t0 = clock()
        for _ in range(calls):
            fn(x)
        return (clock() - t0) / calls


def run(rows: list[int], repeat: int, quick: bool, clock_name: str = "cpu") -> list[str]:
    clock = time.thread_time if clock_name == "cpu" else time.perf_counter
    lines = [f"torch {torch.__version__}, {torch.get_num_threads()} threads, {clock_name} "
             f"time, load {os.getloadavg()[0]:.1f} (1-min average at the start)"]
    shapes = SHAPES[:2] if quick else SHAPES
    for name, n, k in shapes:
        variants = _variants(n, k)
        for m in rows:
            x = torch.randn(m, k)
            calls = 3 if quick else max(5, int(4e7 / (n * k)))
            for fn, _ in variants.values():
                _time(fn, x, 1, clock)  # warm-up
            times: dict[str, list[float]] = {v: [] for v in variants}
            for _ in range(repeat):  # interleaved
                for v, (fn, _) in variants.items():
                    times[v].append(_time(fn, x, calls, clock))
            base = statistics.median(times["f32"])
            for v, ts in times.items():
                med = statistics.median(ts)
                lines.append(f"{name:>8} {n:>5}x{k:<5} rows {m:>3} {v:>14}: {med * 1e6:9.1f} us "
                             f"(spread {min(ts) * 1e6:.0f}-{max(ts) * 1e6:.0f}) "
                             f"{base / med:5.2f}x f32, {variants[v][1] / 2**20:6.2f} MiB read")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", default="cpu", choices=("cpu", "wall"))
    ap.add_argument("--quick", action="store_true", help="two shapes, a few calls")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu times one thread: use --threads 1 (or --clock wall)")
    print("\n".join(run(args.rows, args.repeat, args.quick, args.clock)))


if __name__ == "__main__":
    main()
