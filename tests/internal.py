"""The test run's cluster secret: set for this process (its in-process servers and
clients) and, through the environment, for every service a test starts, so the suite's
real processes authenticate their internal traffic as a deployment does."""

from __future__ import annotations

import collections
import os
from typing import Any

import grpc

from shared import internal_auth
from shared.cluster_config import SECRET_ENV

TEST_SECRET = "overture-test-cluster-secret"


def use_test_secret() -> None:
    os.environ[SECRET_ENV] = TEST_SECRET
    internal_auth.configure(TEST_SECRET)


class _Details(collections.namedtuple(
        "_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                     "compression")), grpc.ClientCallDetails):
    pass


class _SendToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
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
    """A blocking channel that carries the test cluster's token."""
    return grpc.intercept_channel(grpc.insecure_channel(address), _SendToken())
