"""Calibrate the simulator's cost model on the real engine of this machine.

    python -m bench.sim.calibrate --size small --out bench/sim/calibration-cpu-small.json

Writes the random-weight demo model, loads it and drives an ``EngineCore`` in-process at
one torch thread (the share of a core each engine of the local cluster gets), timing
``core.step()`` itself: prefill steps of several new-token counts after several cached
contexts (the context is a prefix the device cache holds from a previous request), and
decode steps of several batch sizes and contexts. Least squares fit the linear model of
``costs.py``. DRAM bandwidth is a timed copy into a pool-sized tensor, the peer link a
timed loopback TCP stream; S3 and the per-load overhead are the engine's and kvstore's
configured priors. About two minutes.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from bench.sim.costs import Calibration
from services.engine.api_types import GenerateRequest, SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.model import load_model, write_demo_model
from services.engine.validation import prepare

MIB = 1 << 20
PREFILL_NEW = (16, 64, 192, 480)
PREFILL_CTX = (0, 512, 1536)
DECODE_BATCH = (1, 4, 12, 24)
DECODE_CTX = (64, 512)
DECODE_STEPS = 6
QUICK_DEVICE_BYTES = 48 * MIB  # bench/eval/profiles.py QUICK: the validation profile


class Bench:
    """An engine core and a way to feed it token ids."""

    def __init__(self, model_dir: Path, dtype: str) -> None:
        self.loaded = load_model(model_dir, dtype=getattr(torch, dtype))
        self.config = EngineConfig(model_path=str(model_dir), dtype=dtype,
                                   device_memory_bytes=256 * MIB)
        self.core = EngineCore(self.config, self.loaded)
        self.rng = torch.Generator().manual_seed(0)
        self.count = 0

    def ids(self, n: int) -> list[int]:
        return torch.randint(16, self.loaded.config.vocab_size, (n,), generator=self.rng).tolist()

    def add(self, ids: list[int], max_tokens: int) -> str:
        self.count += 1
        rid = f"r{self.count}"
        req = GenerateRequest(request_id=rid, prompt_token_ids=tuple(ids),
                              sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        self.core.add(prepare(req, tokenizer=self.loaded.tokenizer, model_name=self.loaded.name,
                              vocab_size=self.loaded.config.vocab_size,
                              max_model_len=self.core.max_model_len,
                              fingerprint=self.loaded.fingerprint))
        return rid

    def timed_steps(self) -> list[float]:
        """Step until idle; each step's seconds."""
        out = []
        while self.core.has_work():
            t0 = time.perf_counter()
            self.core.step()
            out.append(time.perf_counter() - t0)
        return out


def measure_prefill(b: Bench) -> list[tuple[int, int, float]]:
    """(new tokens, cached context, seconds of the one step computing them)."""
    rows = []
    for ctx in PREFILL_CTX:
        for new in PREFILL_NEW:
            times = []
            for _ in range(2):
                prefix = b.ids(ctx + 1)  # +1: the cached prefix is whole blocks of it
                if ctx:
                    b.add(prefix, 1)
                    b.timed_steps()
                b.add(prefix[:ctx] + b.ids(new), 1)
                steps = b.timed_steps()
                times.append(steps[0])
            rows.append((new, ctx, min(times)))
            print(f"prefill new={new:4d} ctx={ctx:5d}: {min(times) * 1e3:8.1f} ms", flush=True)
    return rows


def measure_decode(b: Bench) -> list[tuple[int, int, float]]:
    """(batch, context of the batch in all, median seconds of a decode-only step)."""
    rows = []
    for ctx in DECODE_CTX:
        for batch in DECODE_BATCH:
            for _ in range(batch):
                b.add(b.ids(ctx), DECODE_STEPS + 2)
            steps = b.timed_steps()
            # The last DECODE_STEPS steps decode every sequence (prefills came first).
            dec = statistics.median(steps[-DECODE_STEPS:])
            rows.append((batch, batch * (ctx + DECODE_STEPS), dec))
            print(f"decode batch={batch:3d} ctx={ctx:5d}: {dec * 1e3:8.1f} ms", flush=True)
    return rows


def fit(rows: list[tuple[float, ...]], features) -> list[float]:
    """Non-negative-ish least squares: negative coefficients are clamped to 0 and refit."""
    x = np.array([features(*r[:-1]) for r in rows], dtype=float)
    y = np.array([r[-1] for r in rows], dtype=float)
    keep = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            out = [0.0] * x.shape[1]
            for i, c in zip(keep, coef, strict=True):
                out[i] = max(0.0, float(c))
            return out
        keep.pop(int(np.argmin(coef)))


def dram_bytes_per_s(nbytes: int = 64 * MIB) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def loopback_bytes_per_s(nbytes: int = 128 * MIB) -> float:
    """A TCP stream over loopback, as a peer pull between two nodes of this machine."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def send() -> None:
        conn, _ = server.accept()
        chunk = b"\0" * MIB
        with conn:
            for _ in range(nbytes // MIB):
                conn.sendall(chunk)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    got = 0
    with socket.create_connection(("127.0.0.1", port)) as c:
        t0 = time.perf_counter()
        buf = bytearray(MIB)
        while got < nbytes:
            n = c.recv_into(buf)
            if not n:
                break
            got += n
        seconds = time.perf_counter() - t0
    thread.join()
    server.close()
    return got / seconds


def calibrate(size: str, dtype: str) -> Calibration:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="overture-sim-cal-") as tmp:
        model_dir = write_demo_model(Path(tmp) / size, size)
        b = Bench(model_dir, dtype)
        b.add(b.ids(64), 4)  # warm-up
        b.timed_steps()
        prefill = measure_prefill(b)
        decode = measure_decode(b)
        mc = b.loaded.config
        kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * b.loaded.dtype.itemsize
        num_layers = mc.num_layers
        b.core.close()
    p = fit(prefill, lambda new, ctx: (1.0, new, new * (ctx + new / 2)))
    d = fit(decode, lambda batch, ctx: (1.0, batch, ctx))
    offload = EngineConfig().offload
    return Calibration(
        name=f"cpu-{size}", source=f"bench.sim.calibrate --size {size} on this machine, "
        f"1 torch thread, {dtype}; {time.strftime('%Y-%m-%d')}",
        prefill_base_s=p[0], prefill_s_per_token=p[1], prefill_s_per_token_ctx=p[2],
        decode_base_s=d[0], decode_s_per_seq=d[1], decode_s_per_ctx_token=d[2],
        kv_bytes_per_token=kv_per_token, num_layers=num_layers,
        device_kv_bytes=QUICK_DEVICE_BYTES, dram_bytes=2 << 30,
        dram_bytes_per_s=dram_bytes_per_s(), peer_bytes_per_s=loopback_bytes_per_s(),
        s3_bytes_per_s=1e8, load_overhead_s=offload.load_overhead_s,
        max_num_seqs=64, max_batched_tokens=512, request_overhead_s=0.01, heartbeat_s=1.0,
        block_tokens=16, layer_groups=num_layers,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="small", choices=("tiny", "small"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--out", default="calibration.json")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    cal = calibrate(args.size, args.dtype)
    cal.save(args.out)
    print(f"[{time.monotonic() - t0:.0f} s] wrote {args.out}")


if __name__ == "__main__":
    main()
