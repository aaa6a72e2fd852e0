"""The paged KV pool: ONE tensor for every layer, committed in fixed pages on demand.

    kv_cache: (num_blocks, 2, block_size, num_kv_heads, head_dim)   # [:,0]=K, [:,1]=V

The whole device-memory budget is *reserved* up front (address space only) and *committed*
one page at a time when the block allocator runs dry; whole free pages can be released
again so that several models can share one budget (Prism's kvcached, DESIGN §5).

    bytes:  | page 0                 | page 1                 | ... | page P-1            |
    blocks: | b0 b1 ... b(bpp-1)     | b(bpp) ...             |     |                     |
            block_bytes = 2 * block_size * kv_heads * head_dim * elem_size
            page span  = blocks_per_page * block_bytes   (page_bytes rounded down to blocks)
"""

from __future__ import annotations

import logging

import torch

from services.engine.device import PoolMemory, allocate_pool_memory
from shared.config import ConfigError
from shared.device_ledger import DeviceLedger
from shared.kv_layout import block_bytes

log = logging.getLogger(__name__)


def block_bytes_for(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one pool block: K and V of one layer for ``block_size`` tokens."""
    return block_bytes(block_size, num_kv_heads, head_dim, dtype.itemsize)


class DeviceMemory:
    """Owns the pool memory and which pages of it are committed."""

    def __init__(
        self,
        *,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        budget_bytes: int,
        page_bytes: int,
        device: str = "cpu",
        ledger: DeviceLedger | None = None,
        reserve_bytes: int = 0,
        lendable_bytes: int = 0,
    ) -> None:
        """``ledger``: the node's shared device budget; a page is committed only when the
        ledger grants it (the budget then bounds every engine of the node together).
        ``reserve_bytes``: of it, what the other engines may not take while this pool
        holds less (Prism §6.3), kept while the pool lives. ``lendable_bytes``: address
        space reserved past the budget for weight memory lent as KV (MIRAGE, ``lend``);
        pages there are committed only while lent."""
        self.block_size = block_size
        self._ledger = ledger
        self.dtype = dtype
        self.block_bytes = block_bytes_for(block_size, num_kv_heads, head_dim, dtype)
        self.blocks_per_page = max(1, page_bytes // self.block_bytes)
        self.page_span = self.blocks_per_page * self.block_bytes
        self.base_pages = budget_bytes // self.page_span
        self.num_pages = (budget_bytes + lendable_bytes) // self.page_span
        self.lent_bytes = 0  # weight memory lent as KV capacity (MIRAGE)
        self.node_lent_bytes = 0  # weight memory lent to the node's budget (MIRAGE §5.2)
        if self.base_pages == 0:
            raise ConfigError(
                f"engine.device_memory_bytes: {budget_bytes} bytes cannot hold one KV page of "
                f"{self.page_span} bytes ({self.blocks_per_page} blocks of {self.block_bytes}); "
                "raise it or lower engine.page_bytes"
            )
        self.budget_bytes = budget_bytes
        self.num_blocks = self.num_pages * self.blocks_per_page
        # (on CUDA, pages are backed on demand only when the node shares its budget)
        self._memory: PoolMemory = allocate_pool_memory(
            device, self.num_pages * self.page_span, elastic=ledger is not None)
        self.kv_cache = self._memory.tensor.view(dtype).view(
            self.num_blocks, 2, block_size, num_kv_heads, head_dim
        )  # (num_blocks, 2, block_size, kv_heads, head_dim)
        self._committed = [False] * self.num_pages
        self.num_committed_pages = 0
        # Whole pages; on a node ledger only (alone, the whole budget is this pool's).
        self.reserve_pages = min(self.num_pages, -(-reserve_bytes // self.page_span)) \
            if ledger is not None else 0
        if ledger is not None:
            ledger.reserve(self.reserve_pages * self.page_span)

    @property
    def name(self) -> str:
        """How another process on the node maps this pool (shm path or CUDA IPC handle)."""
        return self._memory.name

    @property
    def shares_budget(self) -> bool:
        """Whether pages come from the node's shared budget (which others may hold)."""
        return self._ledger is not None

    @property
    def page_limit(self) -> int:
        """Pages that may be committed: the budget's, plus the lent bytes' (whole pages):
        those lent to this pool and, on a node ledger, those any engine lent to the node's
        KV (within the address space reserved for lending)."""
        lent = self.lent_bytes + (self._ledger.lent_bytes() if self._ledger else 0)
        return min(self.num_pages, (self.budget_bytes + lent) // self.page_span)

    @property
    def kv_budget_bytes(self) -> int:
        """The KV budget now: the configured one plus the weight bytes lent to it."""
        return self.budget_bytes + self.lent_bytes

    @property
    def budget_blocks(self) -> int:
        """Blocks of the configured budget alone (what a lone sequence can count on)."""
        return self.base_pages * self.blocks_per_page

    def lend(self, nbytes: int) -> None:
        """Count ``nbytes`` of weight memory as KV capacity (MIRAGE §5.5): the page limit
        rises and, on a node ledger, the weights' bytes are handed to KV."""
        self.lent_bytes += nbytes
        if self._ledger is not None:
            self._ledger.give(nbytes, weights=True)

    def take_back(self, nbytes: int) -> bool:
        """Give ``nbytes`` of lent capacity back to the weights. The pages above the new
        limit must be released first (False, nothing changed, if any is committed, or if
        the node's ledger no longer has the bytes for the weights)."""
        limit = min(self.num_pages, (self.budget_bytes + self.lent_bytes - nbytes)
                    // self.page_span)
        if any(self._committed[limit:]):
            return False
        if self._ledger is not None and not self._ledger.take(nbytes, weights=True):
            return False
        self.lent_bytes -= nbytes
        return True

    def lend_to_node(self, nbytes: int) -> bool:
        """Hand ``nbytes`` of the weights this engine holds in the node's ledger to the
        node's KV (MIRAGE §5.2 across the node: an idle model's layers lend first; any
        engine's pool may grow into them, ``page_limit``). False, nothing changed, without
        a ledger or when the engine does not hold that many weight bytes itself (a Reuse
        Store arena's are the store's)."""
        if self._ledger is None or not self._ledger.lend(nbytes):
            return False
        self.node_lent_bytes += nbytes
        return True

    def take_back_from_node(self, nbytes: int) -> bool:
        """Reversion of ``lend_to_node``: the weights take ``nbytes`` back from the node's
        budget; False while the budget does not have them free (KV holds them)."""
        if self._ledger is None or nbytes > self.node_lent_bytes \
                or not self._ledger.unlend(nbytes):
            return False
        self.node_lent_bytes -= nbytes
        return True

    @property
    def num_committed_blocks(self) -> int:
        return self.num_committed_pages * self.blocks_per_page

    @property
    def num_uncommitted_blocks(self) -> int:
        """Blocks of pages that could be committed now: within this pool's reservation and,
        with a node ledger, within what the node's budget has left."""
        # (pages committed into node-lent bytes stay when those are taken back: not below 0)
        local = max(0, self.page_limit * self.blocks_per_page - self.num_committed_blocks)
        if self._ledger is None:
            return local
        return min(local,
                   self._ledger.available_bytes() // self.page_span * self.blocks_per_page)

    def is_committed(self, page: int) -> bool:
        return self._committed[page]

    def page_blocks(self, page: int) -> range:
        return range(page * self.blocks_per_page, (page + 1) * self.blocks_per_page)

    def committed_pages(self) -> list[int]:
        return [p for p, c in enumerate(self._committed) if c]

    def grow(self) -> int | None:
        """Commit the lowest uncommitted page; its index, or None if the budget is used up
        or the memory cannot be had."""
        for page, committed in enumerate(self._committed[:self.page_limit]):
            if not committed:
                if self._ledger is not None and not self._ledger.take(self.page_span):
                    return None  # the node's budget is held by other engines
                if not self._memory.commit(page * self.page_span, self.page_span):
                    if self._ledger is not None:
                        self._ledger.give(self.page_span)
                    return None
                self._committed[page] = True
                self.num_committed_pages += 1
                log.debug(
                    "KV pool committed page %d (%d/%d)",
                    page,
                    self.num_committed_pages,
                    self.num_pages,
                )
                return page
        return None

    def release(self, page: int) -> None:
        """Give a committed page's memory back; its blocks must no longer be in use."""
        if not self._committed[page]:
            raise ValueError(f"KV page {page} is not committed")
        self._memory.release(page * self.page_span, self.page_span)
        if self._ledger is not None:
            self._ledger.give(self.page_span)
        self._committed[page] = False
        self.num_committed_pages -= 1
        log.debug(
            "KV pool released page %d (%d/%d)", page, self.num_committed_pages, self.num_pages
        )

    def resident_bytes(self) -> int:
        """Bytes of pool memory really backed right now (the shm file's allocated size)."""
        return self._memory.resident_bytes()

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.give(self.num_committed_pages * self.page_span)
            self._ledger.reserve(0)
            self.num_committed_pages = 0
        self._memory.close()
