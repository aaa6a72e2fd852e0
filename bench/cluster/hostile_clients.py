"""Slow and oversized clients against the scheduler, with and without its deadlines.

    python -m bench.cluster.hostile_clients [--connections 500] [--uploads 100]
        [--deadline-s 2]

Starts a real scheduler process (anonymous, loopback, no nodes) twice: with the default
deadlines and with them pushed out of reach (the behaviour before they existed), and
measures in each:

- slow headers: ``--connections`` clients send half a request line and stop; how many are
  still open after ``2 * header_timeout_s``;
- stalled uploads: ``--uploads`` clients announce a 4 MiB body, send 1 MiB of it and stop;
  the scheduler's resident memory while they stall and after, and how many it has cut
  off after ``2 * body_timeout_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from bench.harness import start_scheduler

DEADLINE_S = 2.0  # the scheduler's header and body deadlines in the "deadlines" run


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _still_open(writers: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]],
                      wait_s: float) -> int:
    await asyncio.sleep(wait_s)

    async def open_(reader: asyncio.StreamReader) -> bool:
        try:
            data = await asyncio.wait_for(reader.read(65536), 0.05)
            if not data:
                return False
            while data:  # (an answer, then the close)
                data = await asyncio.wait_for(reader.read(65536), 0.5)
            return False
        except TimeoutError:
            return True
        except ConnectionError:
            return False

    results = await asyncio.gather(*(open_(r) for r, _ in writers))
    for _, w in writers:
        w.close()
    return sum(results)


async def _measure(port: int, pid: int, connections: int, uploads: int, wait_s: float
                   ) -> dict[str, float]:
    base = _rss_mb(pid)
    slow = [await asyncio.open_connection("127.0.0.1", port) for _ in range(connections)]
    for _, w in slow:
        w.write(b"GET /v1/mod")
    open_headers = await _still_open(slow, wait_s)
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/json\r\nContent-Length: 4194304\r\n\r\n")
    stalled = [await asyncio.open_connection("127.0.0.1", port) for _ in range(uploads)]
    for _, w in stalled:
        w.write(head + b"[" * (1 << 20))
        await w.drain()
    await asyncio.sleep(0.5)
    peak = _rss_mb(pid)
    open_uploads = await _still_open(stalled, wait_s)
    return {"open_slow_headers": open_headers, "open_stalled_uploads": open_uploads,
            "rss_growth_mb": peak - base, "rss_after_mb": _rss_mb(pid) - base}


def _run(work: Path, flags: dict[str, object], connections: int, uploads: int,
         wait_s: float) -> dict[str, float]:
    with start_scheduler(work, {"no_node_wait_s": 0.1, **flags}) as cluster:
        port = int(cluster.url.rsplit(":", 1)[1])
        return asyncio.run(_measure(port, cluster.procs["scheduler"].popen.pid, connections,
                                    uploads, wait_s))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=500)
    ap.add_argument("--uploads", type=int, default=100)
    ap.add_argument("--deadline-s", type=float, default=DEADLINE_S,
                    help=f"the header and body deadlines tested [{DEADLINE_S:g}]")
    args = ap.parse_args(argv)
    wait_s = 2 * args.deadline_s
    far = 3600.0
    with tempfile.TemporaryDirectory(prefix="overture-bench-") as tmp:
        rows = {
            "deadlines": _run(Path(tmp) / "deadlines",
                              {"header_timeout_s": args.deadline_s,
                               "body_timeout_s": args.deadline_s},
                              args.connections, args.uploads, wait_s),
            "none (baseline)": _run(Path(tmp) / "none",
                                    {"header_timeout_s": far, "body_timeout_s": far,
                                     "keepalive_timeout_s": far},
                                    args.connections, args.uploads, wait_s),
        }
    print(f"{args.connections} slow-header clients, {args.uploads} stalled 4 MiB uploads "
          f"(1 MiB sent), checked {wait_s:g} s later")
    print(f"{'':18}{'open headers':>14}{'open uploads':>14}{'RSS stalled':>13}"
          f"{'RSS after':>11}")
    for name, r in rows.items():
        print(f"{name:18}{r['open_slow_headers']:>14.0f}{r['open_stalled_uploads']:>14.0f}"
              f"{r['rss_growth_mb']:>11.0f}MB{r['rss_after_mb']:>9.0f}MB")


if __name__ == "__main__":
    main()
