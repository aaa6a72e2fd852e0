"""Keep the catalogue's weight files in the node's page cache (Prism §5.2: activation
loads weights from host memory, not disk).

Each model's ``*.safetensors`` files are mapped once per node, read-only and shared, and
the kernel is asked to read them in (``MADV_WILLNEED``). An engine activating the model
maps the same files and finds their pages resident: ``bench.multimodel.activation``
measures the difference. The page cache stays the kernel's to manage: under memory pressure it may
still drop pages, and activation then reads them from disk.
"""

from __future__ import annotations

import logging
import mmap
from pathlib import Path

from shared.model_catalog import ModelEntry

log = logging.getLogger(__name__)


class WeightCache:
    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}

    def hold(self, entries: tuple[ModelEntry, ...]) -> int:
        """Map (and start reading) every weight file of ``entries``; bytes held."""
        total = 0
        for entry in entries:
            for f in sorted(Path(entry.path).glob("*.safetensors")):
                if f in self._maps:
                    continue
                try:
                    with f.open("rb") as fh:
                        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                except (OSError, ValueError) as e:
                    log.warning("weight cache: cannot map %s: %s", f, e)
                    continue
                if hasattr(m, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
                    m.madvise(mmap.MADV_WILLNEED)
                self._maps[f] = m
                total += len(m)
        if total:
            log.info("weight cache: %d MiB of weights mapped for %d models", total >> 20,
                     len(entries))
        return total

    @property
    def bytes(self) -> int:
        return sum(len(m) for m in self._maps.values())

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()
