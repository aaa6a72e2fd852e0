"""The tests' name for the harness's S3 endpoint (``bench/harness/s3.py``): the SeaweedFS
gateway ``overture up`` runs, alone, on free loopback ports."""

from __future__ import annotations

from bench.harness import aws_keys, free_port, s3_keys, start_s3_server

__all__ = ["aws_keys", "free_port", "s3_keys", "start_s3_server"]
