"""The manifest store: what a session's KV is, written once its chunks are durable, and
the latest sequence of each session remembered in memory until its manifest lands."""

from services.kvstore.manifests.manifest import Manifest, manifest_key
from services.kvstore.manifests.manifest_store import ManifestStore

__all__ = ["Manifest", "ManifestStore", "manifest_key"]
