"""``/openapi.json`` describes every route the scheduler serves; its request schemas are
the validation's own (with this server's limits), and real answers match its response
schemas."""

from __future__ import annotations

from contextlib import AsyncExitStack

import jsonschema

from services.scheduler.http import build_app
from tests.unit.scheduler.conftest import call, make_cluster

KEY = {"Authorization": "Bearer key-of-acme1"}
OPS = {"Authorization": "Bearer key-of-ops01"}


def _response_schema(doc: dict, path: str, method: str, status: int) -> dict:
    content = doc["paths"][path][method]["responses"][str(status)]["content"]
    return content["application/json"]["schema"]


async def test_the_document_covers_every_route_and_real_answers_match_it() -> None:
    async with AsyncExitStack() as stack:
        c = await make_cluster(stack, api_keys={"key-of-acme1": "acme"},
                               admin_keys=["key-of-ops01"], max_n=3, max_tokens_limit=50)
        status, doc, _ = await call(c, "GET", "/openapi.json")  # (no key needed)
        assert status == 200 and doc["openapi"].startswith("3.1")
        app = build_app(c.scheduler.state)  # (the routes the server registers)
        served = {(r.resource.canonical, r.method.lower())
                  for r in app.router.routes() if r.method != "HEAD" and r.resource}
        described = {(p, m) for p, ops in doc["paths"].items() for m in ops}
        assert served == described
        chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"][
            "application/json"]["schema"]
        assert chat["properties"]["n"]["anyOf"][0]["maximum"] == 3  # this server's limits
        assert chat["properties"]["max_tokens"]["anyOf"][0]["maximum"] == 50
        body = {"model": "demo", "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": 3, "n": 2}
        for path, sent in (("/v1/chat/completions", body),
                           ("/v1/completions", {"model": "demo", "prompt": ["a b", [1, 2]],
                                                "max_tokens": 2, "return_token_ids": True})):
            status, answer, _ = await call(c, "POST", path, sent, KEY)
            assert status == 200, answer
            jsonschema.validate(answer, _response_schema(doc, path, "post", 200))
        status, answer, _ = await call(c, "GET", "/v1/models", None, KEY)
        jsonschema.validate(answer, _response_schema(doc, "/v1/models", "get", 200))
        status, adv, _ = await call(c, "POST", "/v1/advisory", {
            "session_id": "s", "model": "demo", "successors": [
                {"session_id": "t", "model": "demo"}]}, KEY)
        assert status == 202
        jsonschema.validate(adv, _response_schema(doc, "/v1/advisory", "post", 202))
        path = "/v1/advisory/{advisory_id}"
        status, gone, _ = await call(c, "DELETE", f"/v1/advisory/{adv['advisory_id']}", None,
                                     KEY)
        jsonschema.validate(gone, _response_schema(doc, path, "delete", 200))
        for method, route, sent in (("POST", "/v1/chat/completions", {"n": 4}),
                                    ("DELETE", "/v1/advisory/none", None)):
            status, err, _ = await call(c, method, route, sent, KEY)
            doc_path = path if "advisory" in route else route
            jsonschema.validate(err, _response_schema(doc, doc_path, method.lower(), status))


NEW_FIELDS = {"chat": ("logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
                       "repetition_penalty", "min_p", "logit_bias", "user", "metadata", "store"),
              "completion": ("logprobs", "echo", "best_of", "suffix", "presence_penalty",
                             "frequency_penalty", "logit_bias", "min_p", "user")}


async def test_logprobs_and_sampling_controls_are_described_and_answered_so(
        cluster) -> None:
    status, doc, _ = await call(cluster, "GET", "/openapi.json")
    for path, endpoint in (("/v1/chat/completions", "chat"), ("/v1/completions", "completion")):
        op = doc["paths"][path]["post"]
        props = op["requestBody"]["content"]["application/json"]["schema"]["properties"]
        assert set(NEW_FIELDS[endpoint]) <= set(props)
        assert "X-Overture-Ignored-Fields" in op["responses"]["200"]["headers"]
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "logprobs": True, "top_logprobs": 2, "logit_bias": {"3": 1}}
    for path, sent in (("/v1/chat/completions", chat),
                       ("/v1/completions", {"model": "demo", "prompt": "a b", "max_tokens": 2,
                                            "logprobs": 2, "echo": True})):
        status, answer, _ = await call(cluster, "POST", path, sent)
        assert status == 200 and answer["choices"][0]["logprobs"] is not None, answer
        jsonschema.validate(answer, _response_schema(doc, path, "post", 200))
