"""What of each catalogue model's weights this node holds, from what the node has today
(no Reuse Store): the default ``ResidencySource`` (``shared/model_residency.py``) its
heartbeats report, so that the scheduler places activations by load time (Tangram §3.4).

    a model an engine serves now     resident = total (nothing to load)
    a model no engine serves         resident = its weight files' bytes in the page cache
                                     (``WeightCache.cached_bytes``, asked of the kernel; 0
                                     where it cannot say): what an activation need not
                                     read from disk
    load bandwidth                   measured: the bytes of the models activated here over
                                     the seconds their activations took (the newest
                                     ``WINDOW``), engine start-up included, as a request
                                     waiting for one sees it

A Reuse Store that keeps tensors resident (issue 46 part A) replaces this class: it is
passed to the ``Registrar`` (``nodemgr/app.py:start``) as any ``ResidencySource``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from services.nodemgr.weight_cache import WeightCache
from shared.model_catalog import ModelEntry
from shared.model_residency import ModelResidency

WINDOW = 8  # activations the bandwidth is measured over
CACHE_CHECK_S = 5.0  # the page cache is asked again after this long (mincore costs a scan)


class NodeResidency:
    def __init__(self, catalog: Iterable[ModelEntry], weights: WeightCache,
                 served: Callable[[], list[str]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.catalog = {m.name: m for m in catalog}
        self.weights = weights
        self.served = served  # the models the node's engines serve now
        self._clock = clock
        self._sizes: dict[str, int] = {}
        self._cached: dict[str, tuple[int, float]] = {}  # model -> (bytes, when measured)
        self._loads: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (bytes, seconds)

    def total_bytes(self, model: str) -> int:
        if model not in self._sizes:
            entry = self.catalog.get(model)
            try:
                self._sizes[model] = entry.weight_bytes() if entry is not None else 0
            except OSError:
                self._sizes[model] = 0
        return self._sizes[model]

    def loaded(self, model: str, seconds: float) -> None:
        """An activation of ``model`` took ``seconds`` (the Activator's hook)."""
        size = self.total_bytes(model)
        if size > 0 and seconds > 0:
            self._loads.append((size, seconds))
        self._cached.pop(model, None)

    def load_bytes_per_s(self) -> float:
        seconds = sum(s for _, s in self._loads)
        return sum(b for b, _ in self._loads) / seconds if seconds > 0 else 0.0

    def residency(self) -> list[ModelResidency]:
        active = set(self.served())
        out = []
        for name in sorted(set(self.catalog) | active):
            total = self.total_bytes(name)
            resident = total if name in active else self._page_cached(name)
            out.append(ModelResidency(name, min(resident, total), total, name in active))
        return out

    def _page_cached(self, model: str) -> int:
        entry = self.catalog.get(model)
        if entry is None:
            return 0
        now = self._clock()
        got = self._cached.get(model)
        if got is None or now - got[1] > CACHE_CHECK_S:
            got = (self.weights.cached_bytes(entry) or 0, now)
            self._cached[model] = got
        return got[0]
