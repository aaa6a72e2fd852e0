"""The engine's KV on the device: memory committed in pages (``device_memory``), a block
allocator with refcounts and the prefix cache (``block_allocator``), and per-sequence,
per-layer block tables (``block_tables``)."""

from services.engine.kvcache.block_allocator import BlockAllocator
from services.engine.kvcache.block_tables import BlockTables
from services.engine.kvcache.device_memory import DeviceMemory

__all__ = ["BlockAllocator", "BlockTables", "DeviceMemory"]
