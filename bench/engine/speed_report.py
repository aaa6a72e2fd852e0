"""The report of ``bench.engine.speed``: the table against transformers, the goals, the
memory line, weight bytes read per decoded token against the host's copy bandwidth, and
the ratios against llama.cpp."""

from __future__ import annotations

import statistics
import time

import torch

from bench.engine.speed_workload import BATCHES
from bench.eval.stats import goal_at_most, mean_interval, paired_ratio


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
    if "resident" in ours:
        parts = ours["resident"]
        now = sum(parts.values()) / 2**20
        lines.append(f"resident after the batches: {now:.0f} MiB, {now / held:.2f}x weights + KV "
                     "pool; " + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in parts.most_common()
                                         if v >= 1 << 20) + " MiB")
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
