"""The ``cluster:`` config section every service reads besides its own: what makes it a
member of one cluster. Today that is the internal-traffic secret.

Set it through the environment (``OVERTURE_CLUSTER__SECRET``) or a file
(``OVERTURE_CLUSTER__SECRET_FILE``), not on a command line (``ps`` shows those to every
user). ``overture up`` makes a fresh one per run and hands it to its children that way.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from shared import internal_auth
from shared.config import ConfigError, load, opt
from shared.s3_credentials import S3Credentials, derive_s3_credentials

log = logging.getLogger(__name__)

SECRET_ENV = "OVERTURE_CLUSTER__SECRET"


@dataclass(frozen=True)
class ClusterConfig:
    secret: str = opt(
        "", "shared secret (16+ characters) authenticating internal gRPC calls and chunk "
        "streams between the cluster's services; best given by environment or secret_file",
    )
    secret_file: str = opt("", "a file whose first line is the secret (instead of secret)")
    insecure: bool = opt(
        False, "run without internal authentication; only for services bound to a loopback "
        "address (anything on the network could otherwise register as a node or read KV)",
    )


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_secret(cfg: ClusterConfig) -> str | None:
    """The configured secret (``None``: none configured). Raises ``ConfigError``."""
    if cfg.secret and cfg.secret_file:
        raise ConfigError("cluster.secret and cluster.secret_file are both set; keep one")
    secret = cfg.secret
    if cfg.secret_file:
        try:
            lines = Path(cfg.secret_file).read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"cluster.secret_file: cannot read it ({e.strerror})") from None
        secret = lines[0].strip() if lines else ""
        if not secret:
            raise ConfigError("cluster.secret_file: the file is empty")
    if not secret:
        return None
    if len(secret) < internal_auth.MIN_SECRET_CHARS:
        raise ConfigError(f"cluster.secret must have at least "
                          f"{internal_auth.MIN_SECRET_CHARS} characters")
    return secret


def cluster_s3_credentials(yaml_path: str | Path | None) -> S3Credentials:
    """The S3 pair of the configured cluster secret (the cluster's own S3 server's).
    Raises ``ConfigError`` when no secret is configured."""
    secret = configured_secret(yaml_path)
    if secret is None:
        raise ConfigError("the S3 server's keys derive from the cluster secret: set "
                          "OVERTURE_CLUSTER__SECRET or OVERTURE_CLUSTER__SECRET_FILE")
    return derive_s3_credentials(internal_auth.InternalAuth(secret))


def configured_secret(yaml_path: str | Path | None) -> str | None:
    """The cluster secret the services started with this YAML file and this process's
    environment get (None: none). Raises ``ConfigError``."""
    return resolve_secret(load(ClusterConfig, "cluster", yaml_path=yaml_path,
                               env=os.environ))


def start_internal_auth(cfg: ClusterConfig, service: str, bind_host: str) -> None:
    """Configure this process's internal authentication, or refuse to run without it.
    Raises ``ConfigError`` (the service exits with one line saying what to set)."""
    secret = resolve_secret(cfg)
    if secret is not None:
        internal_auth.configure(secret)
        return
    if not cfg.insecure:
        raise ConfigError(
            "no cluster secret: set OVERTURE_CLUSTER__SECRET (or cluster.secret_file) to the "
            "same value on every service of the cluster (`overture up` makes one itself), "
            "or cluster.insecure: true for services bound to loopback only")
    if not is_loopback(bind_host):
        raise ConfigError(
            f"cluster.insecure is refused for a {service} bound to {bind_host!r}: without a "
            "cluster secret only loopback addresses are allowed")
    internal_auth.configure(None)
    log.warning("%s runs WITHOUT internal authentication (cluster.insecure; loopback only)",
                service)
