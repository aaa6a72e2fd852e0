"""Keyed MACs of the KV the tiers keep: chunks and session manifests, per tenant.

A chunk or a manifest read back from SSD, S3 or a peer is trusted only if its tag was made
with the cluster's key for its tenant over its bytes AND its identity (a chunk's header
names tenant, model, layer and block hashes; a manifest's tag covers its tenant/session
key). So a chunk re-sealed by someone without the cluster secret, or a genuine object
moved to another key (another session's, another tenant's), fails like a corrupt one:
the reader deletes it and the engine recomputes (DESIGN §7).

Keys: ``root = HMAC-SHA256(cluster secret, "overture-kv-mac")`` (``InternalAuth``), and per
tenant ``HMAC-SHA256(root, "tenant\\0" + tenant)``; a process without a cluster secret
(unit tests in-process, ``cluster.insecure``) uses a fixed root, which still detects
corruption but authenticates nothing. The tag is HMAC-SHA256 truncated to 16 bytes:
measured here (``bench/kvstore/chunk_mac.py``) it is about twice as fast as keyed
BLAKE2b where the CPU has SHA extensions, and 128 bits leave a forger 2^-128 a try.
"""

from __future__ import annotations

import hashlib
import hmac

from shared import internal_auth

TAG_BYTES = 16
UNKEYED_ROOT = b"overture-kv-mac: no cluster secret"
CHUNK_DOMAIN = b"overture-chunk-v3\0"
MANIFEST_DOMAIN = b"overture-manifest-v1\0"


def tenant_key(tenant: str) -> bytes:
    """The MAC key of ``tenant``'s objects under this process's cluster secret (~1 us)."""
    auth = internal_auth.current()
    root = auth.kv_mac_root if auth is not None else UNKEYED_ROOT
    return hmac.digest(root, b"tenant\0" + tenant.encode(), "sha256")


def hasher(tenant: str, domain: bytes) -> hmac.HMAC:
    """A running MAC of ``tenant``'s key, fed ``domain`` first (feed it the object's parts
    in order, then ``tag``)."""
    return hmac.new(tenant_key(tenant), domain, hashlib.sha256)


def tag(h: hmac.HMAC) -> bytes:
    return h.digest()[:TAG_BYTES]


def same(a: bytes | memoryview, b: bytes) -> bool:
    """Tags compared in constant time."""
    return hmac.compare_digest(bytes(a), b)
