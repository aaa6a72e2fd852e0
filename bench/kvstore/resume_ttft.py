"""Time to first token when a conversation resumes: recompute vs reused KV from each tier.

    python -m bench.kvstore.resume_ttft [--quick] [--sizes 512,2048,4096] [--reps 3]
        [--samples 3] [--dtype float32] [--demo-size small] [--raw]

The `small` demo model (written to a temp dir), a history of H random tokens already
saved to the node's kvstore (a real ``python -m services.kvstore`` process with RocksDB),
then the history plus a 50-token new message; TTFT through an AsyncEngine for:

- recompute      offload.mode=recompute: the whole prompt is prefilled
- device         the history's KV is still in the engine's device cache
- dram           device cache dropped; KV loaded from the kvstore's DRAM, layer-wise
- dram_whole     the same, but the whole prefix is loaded before the first layer runs
- ssd            the history evicted from the kvstore's DRAM (``Delete`` with
                 ``tiers=["dram"]``, as capacity pressure would), KV loaded from SSD,
                 layer-wise. ``--ssd-after-restart`` restarts the kvstore instead (DRAM
                 empty, its SSD read path warmed on another session): a cold process also
                 pays first-touch page faults for every buffer it fills
- ssd_whole      the same without overlap; its load time alone is also reported

and for SSD the check TTFT <= 1.2 x max(load, compute): load = the SSD load alone
(admission to last layer resident, measured in the ssd_whole run, where nothing overlaps
it), compute = the suffix computed with the prefix resident (the device case).
Goals (issue 5): device >= 20x faster than recompute at 2k tokens, DRAM layer-wise >= 15x.

Each reuse mode is its own engine in its own process, loading the model on its worker
thread as ``python -m services.engine`` does: every thread that runs parallel torch ops
keeps an OpenMP team, and with more team threads than cores libgomp stops spinning
between parallel regions. Three engines sharing this process made the 50-token forward
pass ~30% slower than in a real engine process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import grpc
import torch

from bench.harness import Proc, free_port, start_service, stop_processes, use_cluster_secret
from services.engine.api_types import GenerateRequest, SamplingParams
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig, OffloadConfig
from services.engine.model import write_demo_model
from services.engine.offload.kvstore_wire import DEFAULT_TENANT
from services.models.commands import model_folder
from shared import internal_auth
from shared.aio import freeze_startup_heap
from shared.cluster_config import SECRET_ENV
from shared.proto import kvstore_pb2, kvstore_pb2_grpc

NEW_MESSAGE_TOKENS = 50


@contextlib.contextmanager
def kvstore_process(port: int, ssd_path: Path, log_dir: Path) -> Iterator[Proc]:
    """A real kvstore process (DRAM + RocksDB tiers) on ``port``."""
    proc = start_service("kvstore", {"port": port, "ssd_path": ssd_path, "drain_s": 60},
                         log_dir / "kvstore.log")
    try:
        yield proc
    finally:
        stop_processes([proc], 60.0)


def engine_process(conn: Connection, model: str, address: str, mode: str, dtype: str,
                   threads: int) -> None:
    """A child process serving one engine: commands in, results out over ``conn``."""
    asyncio.run(_serve_engine(conn, model, address, mode, dtype, threads))


async def _serve_engine(conn: Connection, model: str, address: str, mode: str, dtype: str,
                        threads: int) -> None:
    internal_auth.configure(os.environ[SECRET_ENV])  # (the bench's cluster secret)
    # Every reusing engine loads the whole stored prefix (policy "always"): the bench
    # measures each tier's load path, and the cost planner, whose estimates come from
    # loads measured under whatever else the machine is doing, may trim a tail span now
    # and then, which would make a tier's row measure a mixture.
    cfg = EngineConfig(model_path=model, dtype=dtype, device_memory_bytes=3 << 30,
                       max_num_batched_tokens=512, num_threads=threads,
                       offload=OffloadConfig(
                           kvstore_address="" if mode == "recompute" else address,
                           mode=mode, policy="always"))
    async with AsyncEngine(cfg) as eng:
        freeze_startup_heap()  # as services.engine.service does once it is up
        conn.send(("ready", None))
        while True:
            cmd, arg = await asyncio.to_thread(conn.recv)
            if cmd == "stop":
                break
            if cmd == "attach":
                out = eng.kv_connector is None or await eng.kv_connector.attach(timeout=120.0)
            elif cmd == "drop":
                out = await eng.drop_device_cache()
            elif cmd == "status":
                out = (await eng.status()).reuse
            else:  # ("ttft", (ids, session))
                ids, session = arg
                req = GenerateRequest(prompt_token_ids=tuple(ids), session_id=session,
                                      sampling=SamplingParams(max_tokens=1, ignore_eos=True))
                t0 = time.perf_counter()
                cached = 0
                async for o in eng.generate(req):
                    cached = o.cached_tokens
                    break
                out = (time.perf_counter() - t0, cached)
                while (await eng.status()).blocks_used:  # saves in flight pin blocks
                    await asyncio.sleep(0.005)
            conn.send((cmd, out))


class Engine:
    """The parent's handle on one engine process."""

    def __init__(self, ctx, model: str, address: str, mode: str, dtype: str, threads: int):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_process, daemon=True,
                                args=(child, model, address, mode, dtype, threads))
        self.proc.start()

    def call(self, cmd: str, arg=None):
        self.conn.send((cmd, arg))
        return self.conn.recv()[1]

    def started(self) -> None:
        if not self.conn.poll(300):
            raise RuntimeError("engine process did not start")
        self.conn.recv()

    def close(self) -> None:
        with contextlib.suppress(OSError, BrokenPipeError):
            self.conn.send(("stop", None))
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()


@contextlib.contextmanager
def engines(model: str, address: str, dtype: str, threads: int) -> Iterator[dict[str, Engine]]:
    ctx = mp.get_context("spawn")  # no torch state inherited from this process
    out: dict[str, Engine] = {}
    try:
        for name, mode in (("recompute", "recompute"), ("layerwise", "layerwise"),
                           ("whole", "whole_prefix")):
            out[name] = Engine(ctx, model, address, mode, dtype, threads)
        for eng in out.values():
            eng.started()
        yield out
    finally:
        for eng in out.values():
            eng.close()


def attach_all(engs: dict[str, Engine]) -> None:
    for name in ("layerwise", "whole"):
        assert engs[name].call("attach"), "kvstore did not come up"


def ttft(eng: Engine, ids: list[int], session: str) -> tuple[float, int]:
    return eng.call("ttft", (ids, session))


def measure_size(engs: dict[str, Engine], to_ssd: Callable[[str], None], hist: list[int],
                 fresh: Callable[[], list[int]], reps: int, samples: int, session: str,
                 raw: bool) -> dict[str, float]:
    """Each measured request is the history plus a NEW 50-token message (``fresh()``), so
    what is cached or stored is exactly the history and 50 tokens are always computed.

    A repetition times one recompute, then every reuse mode ``samples`` times: a request of
    ~0.2 s is either hit by a neighbour's burst on this shared machine or not, where a
    recompute of seconds averages the bursts out, so the short modes need more samples for
    a median as steady as the recompute's."""
    lw, whole = engs["layerwise"], engs["whole"]
    ttft(lw, hist, session)  # turn 1: computes and saves the history
    res: dict[str, list[float]] = {k: [] for k in
                                   ("recompute", "device", "dram", "dram_whole", "ssd",
                                    "ssd_whole", "ssd_load", "dram_load")}
    reused = len(hist) // 16 * 16

    def reuse_modes() -> None:
        for eng, key in ((lw, "dram"), (whole, "dram_whole")):
            eng.call("drop")
            dt, cached = ttft(eng, hist + fresh(), session)
            st = eng.call("status")
            assert cached == reused, f"{key}: {cached} tokens reused; {st}"
            res[key].append(dt)
            if key == "dram_whole":
                res["dram_load"].append(st.last_load_seconds)
        dt, cached = ttft(lw, hist + fresh(), session)  # the history is on device now
        assert cached == reused, f"device: {cached} tokens reused"
        res["device"].append(dt)
        for eng, key in ((lw, "ssd"), (whole, "ssd_whole")):
            to_ssd(session)  # not in the kvstore's DRAM: the KV comes from RocksDB
            eng.call("drop")
            before = eng.call("status").loaded_tokens.get("ssd", 0)
            dt, cached = ttft(eng, hist + fresh(), session)
            st = eng.call("status")
            assert st.loaded_tokens.get("ssd", 0) - before == cached == reused, (
                f"{key}: {cached} tokens reused; {st}")
            res[key].append(dt)
            if key == "ssd_whole":
                res["ssd_load"].append(st.last_load_seconds)

    for rep in range(-1, reps):  # rep -1 warms this context length up, unmeasured
        if rep < 0:
            for eng in (lw, whole):
                eng.call("drop")
                ttft(eng, hist + fresh(), session)
            ttft(lw, hist + fresh(), session)
            continue
        engs["recompute"].call("drop")  # its own prefix cache must not help
        res["recompute"].append((ttft(engs["recompute"], hist + fresh(), session))[0])
        for _ in range(samples):
            reuse_modes()
    if raw:
        print(json.dumps({k: [round(x * 1000, 1) for x in v] for k, v in res.items()}))
    return {k: statistics.median(v) for k, v in res.items()}


def report(size: int, r: dict[str, float]) -> None:
    base = r["recompute"]
    print(f"\nhistory {size} tokens + {NEW_MESSAGE_TOKENS}-token message (TTFT, median)")
    for key in ("recompute", "device", "dram", "dram_whole", "ssd", "ssd_whole"):
        print(f"  {key:<11} {r[key] * 1000:9.1f} ms   {base / r[key]:7.1f}x vs recompute")
    print(f"  dram: load alone {r['dram_load'] * 1000:.1f} ms")
    load, compute = r["ssd_load"], r["device"]
    bound = 1.2 * max(load, compute)
    ok = "ok" if r["ssd"] <= bound else "MISSED"
    print(f"  ssd: load alone {load * 1000:.1f} ms, suffix compute alone {compute * 1000:.1f} ms;"
          f" TTFT {r['ssd'] * 1000:.1f} ms <= 1.2 x max = {bound * 1000:.1f} ms: {ok}"
          f" (load then compute would pay {(load + compute) * 1000:.1f} ms)")
    if size == 2048:
        for key, goal in (("device", 20.0), ("dram", 15.0)):
            ratio = base / r[key]
            print(f"  goal {key} >= {goal:.0f}x at 2k: {ratio:.1f}x "
                  f"{'met' if ratio >= goal else 'NOT met'}")


def evict_dram(address: str, session: str) -> None:
    """Drop the session's chunks from the kvstore's DRAM tier only (they stay on SSD)."""
    auth = internal_auth.current()
    with grpc.insecure_channel(address) as channel:
        kvstore_pb2_grpc.KVStoreStub(channel).Delete(kvstore_pb2.DeleteRequest(
            session=kvstore_pb2.ManifestRef(tenant=DEFAULT_TENANT, session_id=session),
            with_chunks=True, tiers=["dram"]), timeout=30,
            metadata=auth.metadata() if auth is not None else None)


def run(sizes: list[int], reps: int, samples: int, dtype: str, threads: int,
        ssd_after_restart: bool, raw: bool, model_spec: str = "", demo_size: str = "small"
        ) -> None:
    with tempfile.TemporaryDirectory(prefix="overture-bench-") as tmp:
        if model_spec:
            model = model_folder(model_spec, dtype, Path(".overture/models"))
        else:
            model = write_demo_model(Path(tmp) / demo_size, size=demo_size, seed=0)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        port = free_port()
        address = f"127.0.0.1:{port}"
        ssd = Path(tmp) / "ssd"
        procs: list = []

        def start() -> None:
            stack = contextlib.ExitStack()
            stack.enter_context(kvstore_process(port, ssd, Path(tmp)))
            procs.append(stack)

        start()
        try:
            with engines(str(model), address, dtype, threads) as engs:
                attach_all(engs)

                g = torch.Generator().manual_seed(0)
                warm = torch.randint(16, vocab, (600,), generator=g).tolist()

                def restart() -> None:
                    procs.pop().close()  # drains writes to RocksDB
                    start()
                    attach_all(engs)
                    # A fresh process pays first-call costs a long-running kvstore does not:
                    # warm its SSD read path on another session's KV.
                    for eng in (engs["layerwise"], engs["whole"]):
                        eng.call("drop")
                        ttft(eng, warm, "warm")
                for eng in engs.values():  # warm-up: first-call costs, prefill rate
                    ttft(eng, warm, "warm")
                for size in sizes:
                    hist = torch.randint(16, vocab, (size,), generator=g).tolist()

                    def fresh() -> list[int]:
                        return torch.randint(16, vocab, (NEW_MESSAGE_TOKENS,),
                                             generator=g).tolist()

                    to_ssd = (lambda _: restart()) if ssd_after_restart else (
                        lambda session: evict_dram(address, session))
                    r = measure_size(engs, to_ssd, hist, fresh, reps, samples, f"s{size}", raw)
                    report(size, r)
        finally:
            while procs:
                procs.pop().close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one repetition, 512 and 2048 only")
    ap.add_argument("--sizes", default="512,2048,4096", help="history lengths in tokens")
    ap.add_argument("--reps", type=int, default=3, help="recomputes per size")
    ap.add_argument("--samples", type=int, default=3,
                    help="requests of each reuse mode per repetition")
    ap.add_argument("--raw", action="store_true", help="print every sample (ms, JSON)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="float32 is the faster CPU dtype here (see bench/README.md)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--model", default="",
                    help="a model folder, a .gguf file or a packaged model's name "
                    "(smollm2-135m-instruct); default: a demo model (--demo-size)")
    ap.add_argument("--demo-size", default="small", choices=("tiny", "small"),
                    help="the demo model's size (tiny: a smoke run) [small]")
    ap.add_argument("--ssd-after-restart", action="store_true",
                    help="SSD rows: restart the kvstore instead of evicting its DRAM copy")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    reps = args.reps
    if args.quick:
        sizes, reps, args.samples = [s for s in sizes if s <= 2048] or [512], 1, 1
    threads = args.threads or torch.get_num_threads()
    # The harness's cluster secret, for the kvstore process, the engines and this process.
    use_cluster_secret()
    print(f"resume TTFT: {args.model or args.demo_size + ' demo model'}, {args.dtype}, "
          f"{threads} torch threads, pid {os.getpid()}")
    print("ssd rows: " + ("kvstore restarted (cold process)" if args.ssd_after_restart
                          else "history evicted from the kvstore's DRAM"))
    print(f"medians of {reps} recomputes and {reps * max(1, args.samples)} requests per reuse mode")
    run(sizes, reps, max(1, args.samples), args.dtype, args.threads, args.ssd_after_restart,
        args.raw, args.model, args.demo_size)


if __name__ == "__main__":
    main()
