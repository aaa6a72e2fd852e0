"""``overture`` commands for containers and orchestrators (compose.yaml, deploy/k8s):

    overture init --models DIR [--secret-file F]   one-shot: the demo model (unless a model
                                                   is there) and a cluster secret file
    overture s3-server --dir D [--s3-port P]       the S3 server overture up runs, alone
    overture probe --grpc HOST:PORT | --http URL   a health probe (exit 0 when healthy)

They are what ``overture up`` does for a local cluster, one piece each, so that a
container runs the same code as a laptop.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

from services.s3_server import S3ServerError, S3ServerSpec, s3_server_spec
from shared.cluster_config import cluster_s3_credentials, new_secret
from shared.config import ConfigError

DEMO_MODEL = "demo"  # the folder under --models the init job writes


def cmd_init(args: argparse.Namespace) -> int:
    from services.engine.model import write_demo_model  # heavy (torch): import on demand

    models = Path(args.models)
    target = models / DEMO_MODEL
    if (target / "config.json").exists() or any(models.glob("*/config.json")):
        print(f"overture init: a model is already in {models}; not writing the demo model")
    else:
        write_demo_model(target, size=args.size, seed=0)
        print(f"overture init: wrote the {args.size} demo model to {target}")
    if args.secret_file:
        path = Path(args.secret_file)
        if path.exists() and path.read_text().strip():
            print(f"overture init: keeping the cluster secret in {path}")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
            with os.fdopen(fd, "w") as f:
                f.write(new_secret() + "\n")
            print(f"overture init: wrote a new cluster secret to {path}")
    return 0


def cmd_s3_server(args: argparse.Namespace) -> int:
    """Become ``weed mini`` as ``overture up`` runs it (its ports chosen free but the S3
    one): signals reach the server itself, as a container's stop needs."""

    try:
        spec = s3_server_spec(Path(args.dir), cluster_s3_credentials(None), host=args.host,
                              s3_port=args.s3_port)
        argv = spec.argv()
    except (S3ServerError, ConfigError) as e:
        print(f"overture s3-server: {e}", file=sys.stderr)
        return 2
    if args.host == "0.0.0.0":  # (bind everywhere, advertise the name others dial)
        argv = [a.replace("-ip=0.0.0.0", f"-ip={args.advertise}") for a in argv]
    print(f"overture s3-server: S3 on {args.host}:{spec.ports['s3']}, bucket {spec.bucket}",
          flush=True)
    os.execv(argv[0], argv)
    return 2  # (not reached)


def cmd_probe(args: argparse.Namespace) -> int:
    if args.s3:
        return _probe_s3(args.s3, args.timeout)
    if args.http:
        try:
            with urllib.request.urlopen(args.http, timeout=args.timeout):
                return 0
        except (urllib.error.URLError, OSError) as e:
            print(f"unhealthy: {e}", file=sys.stderr)
            return 1
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(args.grpc) as channel:  # (health needs no cluster token)
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"unhealthy: {e.code().name}", file=sys.stderr)
            return 1
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _probe_s3(endpoint: str, timeout_s: float) -> int:
    """The cluster's S3 server answers a request signed with the cluster's pair (an
    unsigned one gets 403 by design) and has the bucket."""
    try:
        spec = S3ServerSpec(Path("."), "", {}, cluster_s3_credentials(None))
        spec.client(timeout_s, endpoint).head_bucket(Bucket=spec.bucket)
    except Exception as e:  # (a config error, a refusal, a missing bucket: all unhealthy)
        print(f"unhealthy: {e}", file=sys.stderr)
        return 1
    return 0


def add_deploy_parsers(cmds: argparse._SubParsersAction) -> None:
    init = cmds.add_parser("init", help="one-shot set-up of a container deployment: the "
                           "demo model unless a model is mounted, and a cluster secret")
    init.add_argument("--models", required=True, help="the shared models folder")
    init.add_argument("--size", default="tiny", choices=("tiny", "small"),
                      help="demo model size [default: tiny]")
    init.add_argument("--secret-file", default="", help="write a new cluster secret here "
                      "unless the file already holds one")
    init.set_defaults(func=cmd_init)
    s3 = cmds.add_parser("s3-server", help="run the S3 server (SeaweedFS) overture up runs")
    s3.add_argument("--dir", required=True, help="data folder")
    s3.add_argument("--host", default="127.0.0.1", help="address to bind [default: loopback]")
    s3.add_argument("--advertise", default="s3", help="name others reach it by, when bound "
                    "to 0.0.0.0 [default: s3]")
    s3.add_argument("--s3-port", type=int, default=8333, help="S3 port [default: 8333]")
    s3.set_defaults(func=cmd_s3_server)
    probe = cmds.add_parser("probe", help="health probe for containers: exit 0 if healthy")
    what = probe.add_mutually_exclusive_group(required=True)
    what.add_argument("--grpc", help="HOST:PORT of a service's gRPC health endpoint")
    what.add_argument("--http", help="URL answering 200 when healthy")
    what.add_argument("--s3", help="endpoint URL of the cluster's S3 server (a request "
                      "signed with the keys of the cluster secret)")
    probe.add_argument("--timeout", type=float, default=3.0)
    probe.set_defaults(func=cmd_probe)
