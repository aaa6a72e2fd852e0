"""The S3 key pair of the cluster's own S3 server, derived from the cluster secret.

``overture up``, compose and the Kubernetes manifests start a SeaweedFS server that
admits exactly one identity; the kvstores sign their requests with the same pair. Both
sides compute it from the cluster secret (``kvstore.s3.credentials: cluster``), so the
pair is never fixed, never typed, and never on a command line or in a manifest: the
server reads it from an identities file (owner-only) written at its start.

Derivation: ``HMAC-SHA256(secret, "overture-s3-access-key")`` and ``...-secret-key``
(``InternalAuth.derive``), encoded in the alphabets S3 keys use. The same secret gives the
keys of the JWTs SeaweedFS's own parts demand of each other (``security.toml``: the filer
and the volume server answer nobody who has not one), so the filer's port does not serve
the objects the S3 gateway guards.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from pathlib import Path

from shared import internal_auth
from shared.config import ConfigError
from shared.internal_auth import InternalAuth
from shared.s3_config import S3Config

IDENTITY = "overture"


@dataclass(frozen=True)
class S3Credentials:
    access_key_id: str
    secret_access_key: str
    signing_key: str  # (hex) the root of the server's internal JWT keys

    def __repr__(self) -> str:  # (never in a log line)
        return f"S3Credentials(access_key_id={self.access_key_id!r}, secret_access_key=***)"


def derive_s3_credentials(auth: InternalAuth) -> S3Credentials:
    """The pair of the cluster whose secret ``auth`` holds."""
    access = base64.b32encode(auth.derive("overture-s3-access-key")).decode()[:20]
    secret = base64.b64encode(auth.derive("overture-s3-secret-key")).decode()[:40]
    return S3Credentials(access, secret.replace("+", "A").replace("/", "B"),
                         auth.derive("overture-s3-jwt").hex())


def identities(creds: S3Credentials) -> dict[str, object]:
    """SeaweedFS's S3 identities config admitting only ``creds`` (no anonymous identity:
    an unsigned request is refused with 403)."""
    return {"identities": [{
        "name": IDENTITY,
        "credentials": [{"accessKey": creds.access_key_id,
                         "secretKey": creds.secret_access_key}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
    }]}


def security_toml(creds: S3Credentials) -> str:
    """SeaweedFS's ``security.toml``: JWTs required for writes and reads on the volume
    server and on the filer's HTTP port (each purpose its own key)."""
    sections = ("jwt.signing", "jwt.signing.read", "jwt.filer_signing",
                "jwt.filer_signing.read")
    return "".join(f'[{s}]\nkey = "{creds.signing_key}-{i}"\nexpires_after_seconds = 60\n'
                   for i, s in enumerate(sections))


def write_identities(path: Path, creds: S3Credentials) -> None:
    """Write the identities file owner-only (0600), replacing any older one atomically."""
    write_private(path, json.dumps(identities(creds)))


def write_private(path: Path, text: str) -> None:
    """``text`` to ``path``, owner-only (0600), replacing any older file atomically."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)  # (an older tmp file may have had another mode)
    os.replace(tmp, path)


def boto_keys(cfg: S3Config) -> dict[str, str]:
    """boto3's key arguments for ``cfg`` (the kvstores' tier and the scheduler's stored
    responses alike): derived from the cluster secret, configured, or none (its
    default chain)."""
    if cfg.credentials == "cluster":
        auth = internal_auth.current()
        if auth is None:
            raise ConfigError("s3.credentials: 'cluster' derives the S3 keys from the "
                              "cluster secret, and none is set (OVERTURE_CLUSTER__SECRET)")
        creds = derive_s3_credentials(auth)
        return {"aws_access_key_id": creds.access_key_id,
                "aws_secret_access_key": creds.secret_access_key}
    if cfg.access_key_id:
        return {"aws_access_key_id": cfg.access_key_id,
                "aws_secret_access_key": cfg.secret_access_key}
    return {}
