"""API keys and admin keys as the scheduler holds them: SHA-256 digests, never the keys.

A key is configured as itself or as ``sha256:<hex>`` of itself (so a config file, an
environment or a repository need not hold a secret), inline (``scheduler.api_keys``,
``scheduler.admin_keys``), from the environment like any option, or from a YAML file
(``scheduler.keys_file``: ``{api_keys: {key: tenant}, admin_keys: [key]}``). A presented
key is hashed and looked up; keys are never logged.

With no key configured the scheduler refuses to start unless ``scheduler.anonymous`` is
set, and anonymous mode binds loopback only: every caller is tenant ``default`` and the
admin routes are open. ``overture up`` (``make run``) starts that way and says so.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from services.scheduler.api import ApiError
from services.scheduler.config import SchedulerConfig
from shared.cluster_config import is_loopback
from shared.config import ConfigError

DIGEST = re.compile(r"sha256:([0-9a-fA-F]{64})")
ANONYMOUS_TENANT = "default"
TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _stored(key: str, where: str) -> str:
    """The digest a configured key is kept as."""
    m = DIGEST.fullmatch(key.strip())
    if m:
        return m.group(1).lower()
    if key.lower().startswith("sha256:"):
        raise ConfigError(f"{where}: 'sha256:' must be followed by 64 hex digits")
    if len(key) < 8:
        raise ConfigError(f"{where}: a key needs at least 8 characters")
    return digest(key)


@dataclass(frozen=True)
class KeyBook:
    tenants: Mapping[str, str]  # key digest -> tenant
    admins: frozenset[str]  # key digests
    anonymous: bool = False

    @classmethod
    def build(cls, api_keys: Mapping[str, str], admin_keys: Iterable[str],
              anonymous: bool = False) -> KeyBook:
        tenants = {}
        for key, tenant in api_keys.items():
            if not TENANT_NAME.fullmatch(str(tenant)):
                raise ConfigError(f"scheduler.api_keys: tenant {str(tenant)[:70]!r} must be "
                                  "1-64 letters, digits, '_', '.' or '-'")
            tenants[_stored(str(key), "scheduler.api_keys")] = str(tenant)
        admins = frozenset(_stored(str(k), "scheduler.admin_keys") for k in admin_keys)
        if anonymous and (tenants or admins):
            raise ConfigError("scheduler.anonymous is set but keys are configured too; "
                              "keep one")
        return cls(tenants, admins, anonymous)

    def tenant_of(self, authorization: str) -> str:
        """The tenant of an ``Authorization`` header; ``ApiError`` 401 without a known key."""
        if self.anonymous:
            return ANONYMOUS_TENANT
        tenant = self.tenants.get(digest(_bearer(authorization)))
        if tenant is None:
            raise ApiError(401, "missing or unknown API key; send 'Authorization: Bearer "
                           "<key>'", code="invalid_api_key")
        return tenant

    def check_admin(self, authorization: str) -> None:
        """``ApiError`` 401 for no or an unknown key, 403 for a tenant's key."""
        if self.anonymous:
            return
        d = digest(_bearer(authorization))
        if any(hmac.compare_digest(d, a) for a in self.admins):
            return
        if d in self.tenants:
            raise ApiError(403, "this API key may not use admin or operator routes; they "
                           "need a key from scheduler.admin_keys", code="not_admin")
        raise ApiError(401, "admin and operator routes need 'Authorization: Bearer <admin "
                       "key>' (scheduler.admin_keys)", code="invalid_admin_key")


def _bearer(header: str) -> str:
    scheme, _, key = header.partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""


def key_book(config: SchedulerConfig) -> KeyBook:
    """The keys ``config`` names (inline and from its keys file). Raises ``ConfigError``
    for malformed keys, or for none at all without an explicit, loopback-only anonymous
    mode."""
    api_keys: dict[str, str] = {str(k): str(v) for k, v in config.api_keys.items()}
    admin_keys = [str(k) for k in config.admin_keys]
    if config.keys_file:
        more_api, more_admin = _read_keys_file(Path(config.keys_file))
        api_keys.update(more_api)
        admin_keys += more_admin
    book = KeyBook.build(api_keys, admin_keys, config.anonymous)
    if config.anonymous and not is_loopback(config.host):
        raise ConfigError(f"scheduler.anonymous is refused on {config.host!r}: without API "
                          "keys the public API binds loopback only")
    if not (book.tenants or book.anonymous):
        raise ConfigError("no API keys: set scheduler.api_keys (or keys_file), or "
                          "scheduler.anonymous: true for a local cluster on loopback")
    return book


def _read_keys_file(path: Path) -> tuple[dict[str, str], list[str]]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"scheduler.keys_file: cannot read it ({e.strerror})") from None
    except yaml.YAMLError:
        raise ConfigError("scheduler.keys_file: not valid YAML") from None
    if not isinstance(data, dict) or not set(data) <= {"api_keys", "admin_keys"}:
        raise ConfigError("scheduler.keys_file: expected a mapping with api_keys "
                          "({key: tenant}) and/or admin_keys ([key])")
    api, admin = data.get("api_keys") or {}, data.get("admin_keys") or []
    if not isinstance(api, dict) or not isinstance(admin, list):
        raise ConfigError("scheduler.keys_file: api_keys must map keys to tenants and "
                          "admin_keys be a list")
    return {str(k): str(v) for k, v in api.items()}, [str(k) for k in admin]
