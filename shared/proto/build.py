"""Generate Python gRPC code for every ``shared/proto/*.proto`` (run from any directory)."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc_tools
from grpc_tools import protoc


def main() -> int:
    root = Path(__file__).resolve().parents[2]
    protos = sorted(str(p.relative_to(root)) for p in (root / "shared" / "proto").glob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{root}",
        f"-I{include}",
        f"--python_out={root}",
        f"--pyi_out={root}",
        f"--grpc_python_out={root}",
        *protos,
    ]
    rc = protoc.main(args)
    if rc != 0:
        print("protoc failed", file=sys.stderr)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
