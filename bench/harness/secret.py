"""The cluster secret of the clusters the harness starts, and gRPC channels that carry it.

The secret is set for this process (its in-process servers and clients) and, through the
environment, for every service started from it, so that their internal traffic is
authenticated as in a deployment. A bench or a test calling a service's gRPC API directly
(the kvstore, an engine) does it through ``sync_channel``: without the token the service
answers ``UNAUTHENTICATED``.
"""

from __future__ import annotations

import collections
import os
from typing import Any

import grpc

from shared import internal_auth
from shared.cluster_config import SECRET_ENV
from shared.s3_credentials import S3Credentials, derive_s3_credentials

# A fixed secret: the harness's clusters listen on loopback only, and the tests and the
# benches that share one process must agree on it.
CLUSTER_SECRET = "overture-test-cluster-secret"


def use_cluster_secret() -> None:
    """This process, and every service started from it from now on, use ``CLUSTER_SECRET``."""
    os.environ[SECRET_ENV] = CLUSTER_SECRET
    internal_auth.configure(CLUSTER_SECRET)


def cluster_s3_credentials() -> S3Credentials:
    """The S3 pair of ``CLUSTER_SECRET``: what the harness's S3 servers admit."""
    return derive_s3_credentials(internal_auth.InternalAuth(CLUSTER_SECRET))


def s3_keys() -> dict[str, str]:
    """``S3Config`` fields (``kvstore.s3.*``) signing with the harness's pair."""
    c = cluster_s3_credentials()
    return {"access_key_id": c.access_key_id, "secret_access_key": c.secret_access_key}


def aws_keys() -> dict[str, str]:
    """boto3 client arguments signing with the harness's pair."""
    c = cluster_s3_credentials()
    return {"aws_access_key_id": c.access_key_id, "aws_secret_access_key": c.secret_access_key}


class _Details(collections.namedtuple(
        "_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                     "compression")), grpc.ClientCallDetails):
    pass


class _SendToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the token of this process's secret (read at each call) to every call."""

    def _details(self, d: Any) -> _Details:
        auth = internal_auth.current()
        metadata = list(d.metadata or ()) + (list(auth.metadata()) if auth else [])
        return _Details(d.method, d.timeout, metadata, d.credentials,
                        getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)


def sync_channel(address: str) -> grpc.Channel:
    """A blocking channel to ``address`` whose calls carry this process's cluster token."""
    return grpc.intercept_channel(grpc.insecure_channel(address), _SendToken())
