"""The multi-model benchmark's clusters: the demo models (two sizes, each with its TTFT
SLO), the shape of the requests and of a node's KV room, and the ``start_cluster``
arguments of each system (prism, static, static-dl, swap, pool, pool-store) on two nodes.
``load`` and ``search`` replay their traces on them; ``bench.cluster.idle_cost`` measures them idle.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.engine.model import write_demo_model
from shared.model_catalog import ModelEntry, write_catalog

# (name, demo size, seed, TTFT SLO s): two 2-layer and two 4-layer models. Small enough
# that two CPU cores are not the bottleneck: device memory for KV is, as on a GPU.
MODELS = (("tiny-1", "tiny", 1, 0.5), ("tiny-2", "tiny", 2, 0.5),
          ("deep-1", "tiny-deep", 1, 1.0), ("deep-2", "tiny-deep", 2, 1.0))
PAGE = 16 << 10


@dataclass(frozen=True)
class Shape:
    """The requests and the KV room. A node's room holds ``kv_pages`` pages of 16 KiB: a
    2-layer model's request takes (prompt + generated) x 512 B, a 4-layer one's twice.

    A decode step of these models costs little more at batch 8 than at 1 (as on a GPU),
    so a model's throughput grows with how many of its requests hold KV at once. With the
    defaults a request is ~710 tokens (~610 of prompt): ~22 pages for a 2-layer model, ~44
    for a 4-layer one. A static quarter of the room holds two and one of them, and the hot
    model under prism may hold most of the room; but the two cores bind soon after (see
    bench/README.md: the goals are met at 2-5 req/s, not once the cores bind)."""
    kv_pages: int = 256
    prompt_words: int = 300  # ~2 tokens each with the demo models' 3000-token vocabulary
    gen: int = 96
    # Each engine's intra-op threads (0: torch's default, one per core). One, as `overture
    # up` runs them on this 2-core host: each node's share is one core and its engines
    # take one thread per core of it. Eight engines with a team of two each pay a thread
    # wake-up (~60 us) on every parallel op of every step.
    engine_threads: int = 1
    # prism: KV pages each engine holds back from the others while it has fewer (§6.3's
    # buffer per engine, part of Prism's policy): room for a 2-layer model's prompt (~19
    # pages; a 4-layer one's needs ~38). 0 = none.
    kv_reserve_pages: int = 24
    # pool, pool-store: engines a node runs for the four models (the first model's, the
    # rest standby): fewer than the models, so models are evicted and activated (cold
    # starts), as in Prism's engine pool (§5.2).
    pool: int = 2


def write_models(work: Path, count: int = len(MODELS)) -> dict[str, Path]:
    """The first ``count`` of ``MODELS`` written under ``work``: name -> folder."""
    return {name: write_demo_model(work / name, size=size, seed=seed)
            for name, size, seed, _ in MODELS[:count]}


def slos(paths: dict[str, Path]) -> dict[str, float]:
    """The TTFT SLO of each model of ``paths`` (in ``MODELS`` order)."""
    return {m[0]: m[3] for m in MODELS if m[0] in paths}


def cluster_setup(system: str, paths: dict[str, Path], work: Path, shape: Shape
                  ) -> tuple[Path, dict]:
    """The first model and the ``start_cluster`` arguments of ``system`` (two nodes)."""
    weights = {n: sum(f.stat().st_size for f in p.glob("*.safetensors"))
               for n, p in paths.items()}
    kv_room = shape.kv_pages * PAGE  # what the hot model could fill; not all four at once
    budget = sum(weights.values()) + kv_room
    slo = slos(paths)
    names = list(slo)
    catalog = write_catalog(work / f"{system}.yaml", [
        ModelEntry(n, str(paths[n]), ttft_slo_s=slo[n]) for n in names])
    first, rest = paths[names[0]], tuple(paths[n] for n in names[1:])
    common = {"nodes": 2, "dtype": "float32", "ready_timeout": 300.0}
    threads = {"num_threads": shape.engine_threads} if shape.engine_threads else {}
    serve_all = {"max_queue_delay_s": 0.0}  # (prism's node queue refuses nothing either)
    if system == "prism":
        reserve = {"kv_reserve_bytes": shape.kv_reserve_pages * PAGE}
        kw = {"more_models": rest, "node_memory": budget, "models_config": catalog,
              "engine_flags": {"page_bytes": PAGE, "device_memory_bytes": kv_room, **threads,
                               **reserve}}
    elif system in ("static", "static-dl"):
        share = kv_room // len(names)  # (a quarter of the room with the four models)
        kw = {"more_models": rest, "models_config": catalog,
              "engine_flags": {"page_bytes": PAGE, "device_memory_bytes": share,
                               **threads, **serve_all},
              "nodemgr_flags": {} if system == "static-dl" else {"admission_depth": 0}}
    elif system in ("pool", "pool-store"):
        # Prism's node (shared budget, reserve, deadline queue, placement) with an engine
        # pool smaller than the catalogue; pool-store adds the Reuse Store (Tangram §3.1),
        # sized to the budget (as `overture up` sizes it): an evicted model's tensors stay
        # resident while KV does not need the memory, and its next activation maps them.
        store = ({"reuse_store_bytes": budget, "weights_dtype": "float32"}
                 if system == "pool-store" else {})
        kw = {"pool_engines": shape.pool - 1, "node_memory": budget, "models_config": catalog,
              "engine_flags": {"page_bytes": PAGE, "device_memory_bytes": kv_room, **threads,
                               "kv_reserve_bytes": shape.kv_reserve_pages * PAGE},
              "nodemgr_flags": {"evict_idle_s": 0, **store}}
    else:  # swap: one engine a node, the whole budget for the model in it
        kw = {"models_config": catalog, "node_memory": budget,
              "engine_flags": {"page_bytes": PAGE, "device_memory_bytes": kv_room,
                               **threads, **serve_all},
              "nodemgr_flags": {"evict_idle_s": 0}}
    return first, {**common, **kw}
