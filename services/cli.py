"""The ``overture`` command.

    overture up [--nodes N] [--port P] [--model PATH]... [--node-memory B] [--dtype D]
                [--config FILE] [--no-s3] [--cores divided|shared]
    overture models list | prepare NAME|FILE.gguf [--dtype D] [--out DIR]
    overture demo-model PATH [--size tiny|small] [--seed S] [--several N [--share F]]
    overture scheduler|nodemgr|engine|kvstore [flags]    (one service, in this process)

``up`` starts the cluster's S3 server (SeaweedFS, the shared durable tier every kvstore
uses; not with ``--no-s3`` or when the config has a ``kvstore.s3`` section), then the scheduler and,
per node, a kvstore, an engine and a node manager as child processes on free loopback
ports, prefixes and streams their logs, and prints the URL when the cluster serves. A
child that dies is restarted after a backoff; one that keeps crashing takes its node down
(the other nodes keep serving), or the whole cluster if it is the scheduler or the S3
server. Ctrl-C or SIGTERM stops everything (SIGTERM, then SIGKILL after a grace period;
the S3 server last, once the kvstores have drained their writes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import runpy
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from services.deploy_commands import add_deploy_parsers
from services.local_cluster import (
    catalog_file,
    cluster_specs,
    has_catalog,
    node_ledgers,
    reuse_store_flags,
    write_file_sd,
)
from services.models.catalog import DEFAULT_MODEL, PACKAGED, ModelNotFound
from services.models.commands import add_models_parser, model_folder
from services.models.commands import cmd_models as models_command
from services.models.prepare import ModelPrepareError, slug
from services.s3_server import S3ServerError, s3_server_spec
from services.supervisor import supervise
from shared.cluster_config import SECRET_ENV, cluster_s3_credentials, new_secret
from shared.config import ConfigError, load_yaml, parse_size
from shared.cpus import available_cpus, divide_cpus, format_cpus

SERVICES = ("scheduler", "nodemgr", "engine", "kvstore")
STATE_DIR = Path(".overture")
# Every service's /metrics, for a Prometheus file_sd_configs entry (or the eval runner).
METRICS_FILE_SD = "prometheus-targets.json"
DEMO_DIR = STATE_DIR / "models"


def ensure_demo_model(size: str, root: Path = DEMO_DIR) -> Path:
    """The demo model folder under ``.overture/models``, written on first use."""
    path = root / f"demo-{size}"
    if not (path / "config.json").exists():
        from services.engine.model import write_demo_model  # heavy (torch): import on demand

        print(f"writing the {size} demo model to {path} ...", flush=True)
        # Write beside, then rename: an interrupted first run leaves no half-written model.
        tmp = root / f".demo-{size}.{os.getpid()}"
        write_demo_model(tmp, size=size, seed=0)
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    return path


# ---------------------------------------------------------------------------------------
# commands


def _yaml_section_value(config: str | None, section: str, key: str) -> object | None:
    if not config:
        return None

    sect = load_yaml(config).get(section) or {}
    return sect.get(key) if isinstance(sect, dict) else None


def cmd_up(args: argparse.Namespace) -> int:

    try:
        port = args.port or _yaml_section_value(args.config, "scheduler", "port") or 8000
        # A GGUF (the packaged default too) is served as shipped, its 4-bit weights kept
        # (q4); a float folder in float32, the fast CPU dtype. The YAML file's dtype wins.
        dtype = args.dtype or (
            None if _yaml_section_value(args.config, "engine", "dtype") else _default_dtype(args)
        )
    except ConfigError as e:
        print(f"overture up: {e}", file=sys.stderr)
        return 2
    try:
        dt = dtype or str(_yaml_section_value(args.config, "engine", "dtype"))
        chosen = [_model(args, dt, spec) for spec in (args.model or [None])]
    except (ModelNotFound, ModelPrepareError) as e:
        print(f"overture up: {e}", file=sys.stderr)
        return 2
    _cluster_secret(args.config)
    s3 = None
    if not args.no_s3 and not _yaml_section_value(args.config, "kvstore", "s3"):
        try:
            s3 = s3_server_spec((STATE_DIR / "s3").resolve(),
                                cluster_s3_credentials(args.config))
            s3.argv()  # the binary is there (S3ServerError otherwise)
        except (S3ServerError, ConfigError) as e:
            print(f"overture up: {e}", file=sys.stderr)
            return 2
    anonymous = not _has_api_keys(args.config)
    if anonymous:
        print("overture up: no API keys configured: the public API is anonymous (every "
              "caller is tenant 'default') and bound to 127.0.0.1")
    (model, served), more = chosen[0], tuple(
        (str(Path(m).resolve()), name) for m, name in chosen[1:])
    ledgers = node_ledgers(args.nodes, args.node_memory) if more else None
    catalog = catalog_file(args.config, [(str(Path(m).resolve()), name or Path(m).name)
                                         for m, name in chosen], STATE_DIR) if more else args.config
    if more:
        print(f"{len(chosen)} models on every node, sharing {args.node_memory >> 20} MiB of "
              "device memory a node", flush=True)
    models_config = catalog if catalog and has_catalog(catalog) else None
    store, why = reuse_store_flags(dt, args.node_memory, args.config)
    if models_config:
        print(f"overture up: {why}", flush=True)
    specs, url = cluster_specs(
        anonymous=anonymous,
        s3=s3,
        nodes=args.nodes,
        http_port=int(str(port)),
        model_path=str(Path(model).resolve()),
        dtype=dtype,
        served_name=served,
        more_models=more,
        ledgers=ledgers,
        models_config=models_config,
        reuse_store=store,
        config=args.config,
        # The SSD tier is on by default, under .overture/<node>/, unless the YAML places it.
        state_dir=None if _yaml_section_value(args.config, "kvstore", "ssd_path") else STATE_DIR,
        cores=_node_cores(args),
    )
    targets = write_file_sd(specs, STATE_DIR / METRICS_FILE_SD)
    print(f"metrics of every service: {targets} (Prometheus file_sd_configs; also "
          "GET /admin/nodes)", flush=True)
    try:
        return asyncio.run(supervise(specs, url, args.nodes, args.ready_timeout))
    finally:
        for ledger in ledgers or ():
            ledger.unlink(missing_ok=True)


def _has_api_keys(config: str | None) -> bool:
    keys = ("api_keys", "admin_keys", "keys_file")
    return any(os.environ.get(f"OVERTURE_SCHEDULER__{k.upper()}") for k in keys) or any(
        _yaml_section_value(config, "scheduler", k) for k in (*keys, "anonymous"))


def _cluster_secret(config: str | None) -> None:
    """Unless the operator gave one (environment or YAML), a fresh cluster secret for this
    run, handed to every child through its environment (never on a command line)."""

    if os.environ.get(SECRET_ENV) or os.environ.get(SECRET_ENV + "_FILE") or any(
            _yaml_section_value(config, "cluster", k) for k in ("secret", "secret_file")):
        print("overture up: internal traffic authenticated with the configured cluster secret")
        return
    os.environ[SECRET_ENV] = new_secret()
    print("overture up: internal traffic authenticated with a fresh cluster secret")


def _node_cores(args: argparse.Namespace) -> list[tuple[int, ...]] | None:
    """Each node's share of this host's cores (``--cores divided``), or None (shared: every
    engine may use every core, as when the config pins them itself)."""
    if args.cores == "shared" or _yaml_section_value(args.config, "engine", "cpus"):
        return None
    shares = divide_cpus(available_cpus(), args.nodes)
    print("cores per node: " + "; ".join(
        f"node{i} {format_cpus(c)}" for i, c in enumerate(shares)), flush=True)
    return shares


def _default_dtype(args: argparse.Namespace) -> str:
    """q4 when every model served is a GGUF file or a packaged one, else float32."""
    specs = args.model or ([] if args.size is not None else [DEFAULT_MODEL])
    gguf = specs and all(s in PACKAGED or s.lower().endswith(".gguf") for s in specs)
    return "q4" if gguf else "float32"


def _model(args: argparse.Namespace, dtype: str, spec: str | None) -> tuple[str, str]:
    """(folder, served name) to serve: ``spec`` (one ``--model``: a folder, a .gguf file or
    a packaged model, prepared on first use), the demo model of ``--size``, or the packaged
    default. A prepared model is served under its own name, not its folder's (which says
    dtype)."""
    if spec is None and args.size is not None:
        return str(ensure_demo_model(args.size)), ""
    if spec is None:
        spec = DEFAULT_MODEL
        print(f"serving {DEFAULT_MODEL} (pass --model or --size to choose another)",
              flush=True)
    folder = model_folder(spec, dtype, DEMO_DIR)
    if spec in PACKAGED:
        return str(folder), spec
    if spec.lower().endswith(".gguf"):
        return str(folder), slug(Path(spec).name)
    return str(folder), ""


def _size(text: str) -> int:

    return parse_size(text)


def cmd_models(args: argparse.Namespace) -> int:
    return models_command(args, DEMO_DIR)


def _interruptible(
    func: Callable[[argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """Ctrl-C before the supervisor takes over (e.g. while writing the demo model) exits
    quietly instead of with a traceback."""

    def wrapper(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130

    return wrapper


def cmd_demo_model(args: argparse.Namespace) -> int:
    from services.engine.model import write_demo_model  # heavy (torch): import on demand

    if args.several and args.share is not None:
        # Fine-tunes of one base sharing a fraction of their tensors (Tangram's reuse):
        # model i keeps ``share`` of the base's bytes and redraws the rest from seed i.
        if not 0.0 <= args.share <= 1.0:
            print("--share must be between 0 and 1", file=sys.stderr)
            return 2
        for seed in range(1, args.several + 1):
            path = Path(args.path) / f"{args.size}-share-{seed}"
            write_demo_model(path, size=args.size, seed=seed, base_seed=0, share=args.share)
            print(f"wrote the {args.size} demo model {seed} (sharing {args.share:.0%} of "
                  f"its tensor bytes with the others) to {path}")
        return 0
    if args.several:
        # Several models of each size (different seeds) for trying multi-model serving:
        # overture up --model DIR/tiny-1 --model DIR/small-1 ...
        for size in args.size.split(","):
            for seed in range(1, args.several + 1):
                path = Path(args.path) / f"{size}-{seed}"
                write_demo_model(path, size=size, seed=seed)
                print(f"wrote the {size} demo model (seed {seed}) to {path}")
        return 0
    write_demo_model(Path(args.path), size=args.size, seed=args.seed)
    print(f"wrote the {args.size} demo model to {args.path}")
    return 0


def run_service(name: str, argv: Sequence[str]) -> int:
    """Run ``python -m services.<name>`` in this process with ``argv`` as its flags."""
    saved = sys.argv
    sys.argv = [f"overture {name}", *argv]
    try:
        runpy.run_module(f"services.{name}", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def cmd_secret(args: argparse.Namespace) -> int:

    print(new_secret())
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="overture",
        description="Overture: serve LLMs with a tiered KV cache moved into place ahead of "
        "requests.",
        epilog="Run one service: overture {scheduler,nodemgr,engine,kvstore} [--help | flags]",
    )
    cmds = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up = cmds.add_parser("up", help="start a local cluster (scheduler + N nodes)")
    up.add_argument("--nodes", type=int, default=1, help="number of nodes [default: 1]")
    up.add_argument("--port", type=int, default=None, help="public HTTP port [default: 8000]")
    up.add_argument(
        "--model",
        action="append",
        default=None,
        help="a packaged model's name, a .gguf file (converted once into .overture/models) "
        f"or a local Hugging Face folder [default: {DEFAULT_MODEL}, prepared on first run]; "
        "repeat it to serve several models, an engine each on every node, sharing the "
        "node's device memory",
    )
    up.add_argument(
        "--node-memory",
        type=_size,
        default=2 << 30,
        help="device memory a node's engines share when it serves several models (weights "
        "and KV; with a catalogue also the cap of its Reuse Store) [default: 2GiB]",
    )
    up.add_argument(
        "--size",
        default=None,
        choices=("tiny", "small"),
        help="serve a random-weight demo model of this size instead (tests, benchmarks)",
    )
    up.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16", "q8_0", "q4"),
        help="engine dtype; q4 / q8_0 keep weights in int4 / int8 (a GGUF's as shipped) "
        "[default: engine.dtype from --config, else q4 for GGUF and packaged models, float32 "
        "for folders]",
    )
    up.add_argument(
        "--cores",
        default="divided",
        choices=("divided", "shared"),
        help="divided: each node's engine and kvstore run on their own share of this host's "
        "cores (affinity and one torch thread per core); shared: every engine uses every "
        "core (the baseline; slower as soon as two engines are busy) [default: divided]",
    )
    up.add_argument("--config", default=None, help="YAML file with a section per service")
    up.add_argument(
        "--no-s3",
        action="store_true",
        help="start no S3 server: the kvstores keep KV in DRAM and SSD only (sessions then "
        "move between nodes only by peer pulls); an S3 endpoint given in the config's "
        "kvstore.s3 section is used instead of starting one",
    )
    up.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for the cluster to serve [default: 600]",
    )
    up.set_defaults(func=_interruptible(cmd_up))
    add_models_parser(cmds).set_defaults(func=_interruptible(cmd_models))
    dm = cmds.add_parser("demo-model", help="write a random-weight demo model and tokenizer")
    dm.add_argument("path", help="folder to write")
    dm.add_argument("--size", default="tiny", help="tiny or small; with --several, a comma "
                    "list (tiny,small) [default: tiny]")
    dm.add_argument("--several", type=int, default=0, metavar="N",
                    help="write N models of each --size into PATH/<size>-<seed> instead")
    dm.add_argument("--seed", type=int, default=0, help="weight seed [default: 0]")
    dm.add_argument("--share", type=float, default=None, metavar="F",
                    help="with --several: the models are fine-tunes of one base sharing a "
                    "fraction F of their weight bytes (whole tensors), written to "
                    "PATH/<size>-share-<i>")
    dm.set_defaults(func=_interruptible(cmd_demo_model))
    sec = cmds.add_parser("secret", help="print a new random cluster secret (for "
                          "OVERTURE_CLUSTER__SECRET or cluster.secret_file)")
    sec.set_defaults(func=cmd_secret)
    add_deploy_parsers(cmds)
    for name in SERVICES:
        cmds.add_parser(
            name, help=f"run the {name} service (see overture {name} --help)", add_help=False
        )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SERVICES:
        return run_service(argv[0], argv[1:])
    args = _parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
