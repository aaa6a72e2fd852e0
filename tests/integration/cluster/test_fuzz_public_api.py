"""Fuzzing the public API from its own description: schemathesis generates requests from
``/openapi.json`` (valid ones and, for every field, invalid ones) and sends them to a real
one-node cluster. Every answer must be no 5xx, come in time, carry a status the document
declares, and match the declared shape (every error in the OpenAI error shape). Bounded:
a few dozen cases an operation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.cluster import Cluster, start_cluster

KEY = {"Authorization": "Bearer key-of-fuzzer"}
EXAMPLES = 10  # an operation and mode (derandomized: the same cases every run)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    flags = {"anonymous": "false", "api_keys": "key-of-fuzzer=fuzz",
             "admin_keys": "key-of-operator", "max_tokens_limit": 8, "max_n": 2,
             "max_prompts": 2, "max_messages": 8,
             # A body without max_tokens (the fuzzer drops optional fields) is bounded too,
             # not run to the whole context on a loaded machine.
             "default_max_tokens": 8}
    with start_cluster(tmp_path_factory.mktemp("fuzz"), tiny_model,
                       scheduler_flags=flags) as c:
        yield c


# (schemathesis's pytest plugin does not run under this pytest: driven through hypothesis)
@pytest.mark.slow
@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode))
def test_no_answer_breaks_the_description(cluster: Cluster,
                                          mode: schemathesis.GenerationMode) -> None:
    api = schemathesis.openapi.from_url(cluster.url + "/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 12
    for op in operations:
        if mode == schemathesis.GenerationMode.NEGATIVE and not (
                op.body or op.path_parameters or op.headers or op.query):
            continue  # (nothing to make invalid)

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def one(case: schemathesis.Case) -> None:
            case.call_and_validate(headers=KEY, timeout=30, checks=CHECKS)

        one()
    # The fuzzing went through: the cluster still serves.
    status, _ = cluster.post_as(KEY, "/v1/chat/completions", {
        "model": "demo-tiny", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2})
    assert status == 200
