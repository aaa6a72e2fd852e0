"""What the multi-model cluster costs in CPU while it serves nothing, by service.

    python -m bench.cluster.idle_cost [--systems prism,swap] [--seconds 30]
        [--broker-interval-s 0.1]

The multi-model benchmark's clusters (``bench.multimodel.clusters``: two nodes; prism with
eight engines) are started, left idle for a settling time, then the CPU seconds each
service's processes use over ``--seconds`` are read from /proc (the cluster's own
processes, by pid: another cluster on the host is not counted). On two cores whatever
the cluster spends doing nothing is taken from the requests under load.
``--broker-interval-s`` sets the nodemgr's memory broker period (it asks every engine of
its node for its Status each round).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.harness import Cluster, start_cluster
from bench.multimodel.clusters import Shape, cluster_setup, write_models

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_by_service(cluster: Cluster) -> dict[int, tuple[str, float]]:
    """pid -> (service, CPU seconds so far) of every live process of ``cluster``."""
    out = {}
    for name, proc in cluster.procs.items():
        service = name.rpartition(".")[2].rstrip("0123456789")  # node0.engine3 -> engine
        try:
            with open(f"/proc/{proc.popen.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # (gone meanwhile)
        out[proc.popen.pid] = (service, (int(fields[11]) + int(fields[12])) / _TICK)
    return out


def idle_cpu(system: str, paths: dict[str, Path], work: Path, seconds: float,
             settle_s: float, broker_interval_s: float) -> dict[str, tuple[int, float]]:
    """service -> (processes, CPU seconds over ``seconds`` of idling)."""
    first, kw = cluster_setup(system, paths, work, Shape())
    kw["nodemgr_flags"] = {**kw.get("nodemgr_flags", {}),
                           "broker_interval_s": broker_interval_s}
    with start_cluster(work / system, first, **kw) as cluster:
        time.sleep(settle_s)
        before = cpu_by_service(cluster)
        time.sleep(seconds)
        after = cpu_by_service(cluster)
    used: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for pid, (service, cpu) in after.items():
        if pid in before:
            used[service] += cpu - before[pid][1]
            count[service] += 1
    return {s: (count[s], used[s]) for s in sorted(used)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", default="prism,swap")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--settle-s", type=float, default=10.0)
    ap.add_argument("--broker-interval-s", type=float, default=0.1)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        paths = write_models(work)
        for system in args.systems.split(","):
            got = idle_cpu(system, paths, work, args.seconds, args.settle_s,
                           args.broker_interval_s)
            total = sum(cpu for _, cpu in got.values())
            parts = ", ".join(f"{s} x{n} {cpu:.2f}" for s, (n, cpu) in got.items())
            print(f"{system}: {total:.2f} CPU-s in {args.seconds:g} s idle "
                  f"({100 * total / args.seconds / (os.cpu_count() or 1):.1f}% of the "
                  f"cores; {parts})", flush=True)


if __name__ == "__main__":
    main()
