"""API and admin keys: kept as digests (a config may hold ``sha256:`` of a key instead of
the key), read from a file or the environment too; no keys means no start unless
anonymous mode is asked for on loopback; 401 for no or an unknown key, 403 for a tenant's
key on an operator route; health stays open."""

from __future__ import annotations

import hashlib
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from services.scheduler.api import ApiError
from services.scheduler.config import SchedulerConfig
from services.scheduler.tenants import KeyBook, key_book
from shared.config import ConfigError, load
from tests.unit.scheduler.conftest import call, make_cluster


def _cfg(**values: object) -> SchedulerConfig:
    return load(SchedulerConfig, "scheduler", overrides=values)


def test_keys_are_kept_as_digests_and_may_be_configured_as_one(tmp_path: Path) -> None:
    hashed = "sha256:" + hashlib.sha256(b"key-of-beta").hexdigest()
    keys = tmp_path / "keys.yaml"
    keys.write_text("api_keys: {key-of-gamma: gamma}\nadmin_keys: [the-admin-key]\n")
    book = key_book(_cfg(api_keys={"key-of-alpha": "alpha", hashed: "beta"},
                         keys_file=str(keys)))
    assert "key-of-alpha" not in repr(book)  # (only digests are held)
    assert book.tenant_of("Bearer key-of-alpha") == "alpha"
    assert book.tenant_of("bearer  key-of-beta ") == "beta"
    assert book.tenant_of("Bearer key-of-gamma") == "gamma"
    book.check_admin("Bearer the-admin-key")
    for header, status in (("", 401), ("Bearer nope-nope", 401), ("key-of-alpha", 401),
                           ("Bearer key-of-alpha", 403)):
        with pytest.raises(ApiError) as e:
            book.check_admin(header)
        assert e.value.status == status
    with pytest.raises(ApiError) as e:
        book.tenant_of("Bearer the-admin-key")  # an admin key is no tenant's
    assert e.value.status == 401


def test_environment_keys_and_bad_configurations() -> None:
    env = {"OVERTURE_SCHEDULER__API_KEYS": "key-one-abc=one, a2V5LXR3bw===two"}
    cfg = load(SchedulerConfig, "scheduler", env=env)
    assert cfg.api_keys == {"key-one-abc": "one", "a2V5LXR3bw==": "two"}
    bad = [
        ({}, "no API keys"),
        ({"anonymous": True, "host": "0.0.0.0"}, "loopback"),
        ({"anonymous": True, "api_keys": {"key-of-alpha": "a"}}, "keep one"),
        ({"api_keys": {"short": "a"}}, "8 characters"),
        ({"api_keys": {"sha256:abc": "a"}}, "64 hex"),
        ({"api_keys": {"key-of-alpha": "a/b"}}, "tenant"),
        ({"keys_file": "/nonexistent/keys.yaml"}, "cannot read"),
    ]
    for values, message in bad:
        with pytest.raises(ConfigError, match=message):
            key_book(_cfg(**values))
    assert key_book(_cfg(anonymous=True)).tenant_of("") == "default"
    assert KeyBook.build({}, [], anonymous=True).anonymous


async def test_every_route_but_health_needs_a_key() -> None:
    async with AsyncExitStack() as stack:
        c = await make_cluster(stack, api_keys={"key-of-acme": "acme"},
                               admin_keys=["key-of-ops1"])
        user = {"Authorization": "Bearer key-of-acme"}
        ops = {"Authorization": "Bearer key-of-ops1"}
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                             ("POST", "/v1/completions"), ("POST", "/v1/advisory"),
                             ("DELETE", "/v1/advisory/adv-x"), ("GET", "/admin/nodes")):
            status, err, _ = await call(c, method, path, {})
            assert status == 401 and err["error"]["type"] == "authentication_error", path
        async with c.http.get(c.url + "/metrics") as r:
            assert r.status == 401
        async with c.http.get(c.url + "/metrics", headers=user) as r:
            assert r.status == 403
        async with c.http.get(c.url + "/metrics", headers=ops) as r:
            assert r.status == 200 and "overture_" in await r.text()
        assert (await call(c, "GET", "/v1/models", None, user))[0] == 200
        for path in ("/healthz", "/readyz"):
            async with c.http.get(c.url + path) as r:
                assert r.status == 200, path
