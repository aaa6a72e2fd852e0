"""Per-sequence, per-layer block tables over the block allocator, with prefix reuse by hash.

A sequence holds ``ceil(tokens / block_size)`` blocks in EVERY layer's table:

    layer L-1: [b.. b.. b..]
    ...
    layer 0:   [b.. b.. b..]      block i of layer l holds tokens [i*bs, (i+1)*bs)

Prefix reuse on the device: full block i of the prompt is reused as is only if the block
with key ``(h_i, l)`` is cached for every layer ``l`` (a missing layer would have to be
recomputed, and recomputing one layer means recomputing all of them). Past that prefix,
blocks whose lower layers ``[0, k)`` are cached (a prefetch whose upper layers were
purged, Symphony §3.4) are *partially resident*: usable when the kvstore can supply the
upper layers ``[k, L)``, which are then loaded into new blocks while the lower ones are
already there for the forward pass.
"""

from __future__ import annotations

from services.engine.kvcache.block_allocator import BlockAllocator
from services.engine.sequence import Sequence
from shared.hashing import extend_block_hashes


class BlockTables:
    def __init__(self, blocks: BlockAllocator, num_layers: int, block_size: int) -> None:
        self.blocks = blocks
        self.num_layers = num_layers
        self.block_size = block_size

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks (over all layers) to allocate before computing ``num_new_tokens`` more."""
        per_layer = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, per_layer - seq.num_blocks) * self.num_layers

    def find_cached_prefix(self, seq: Sequence) -> list[list[int]]:
        """Cached blocks ``[block index][layer]`` of the longest reusable prefix.

        At least the last token is always left to compute (its logits are needed).
        """
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, seq.hash_seed)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hit: list[list[int]] = []
        for h in seq.block_hashes[:max_blocks]:
            layers = [self.blocks.cached_block((h, layer)) for layer in range(self.num_layers)]
            if any(b is None for b in layers):
                break
            hit.append(layers)  # type: ignore[arg-type]
        return hit

    def find_partial_run(self, seq: Sequence, start: int) -> tuple[list[list[int]], int]:
        """Blocks ``[start, start + n)`` whose layers ``[0, k)`` are cached, ``k >= 1`` the
        fewest leading layers any of them has: ``([block][layer < k], k)``; ``([], 0)``
        when block ``start`` has no layer 0 cached. (After ``find_cached_prefix``.)"""
        max_blocks = (seq.num_tokens - 1) // self.block_size
        run: list[list[int]] = []
        k = self.num_layers
        for h in seq.block_hashes[start:max_blocks]:
            layers: list[int] = []
            for layer in range(k):
                b = self.blocks.cached_block((h, layer))
                if b is None:
                    break
                layers.append(b)
            if not layers:
                break
            k = len(layers)
            run.append(layers)
        return [blocks[:k] for blocks in run], (k if run else 0)

    def peek_cached_blocks(self, hashes: list[bytes]) -> int:
        """How many leading ``hashes`` are cached in every layer now. A hint only: safe to
        call from another thread (dict reads), but the answer may be stale by admission."""
        n, cached = 0, self.blocks.cached_block
        for h in hashes:
            if any(cached((h, layer)) is None for layer in range(self.num_layers)):
                break
            n += 1
        return n

    def table_slice(self, seq: Sequence, first_block: int, end_block: int) -> list[int]:
        """``seq``'s blocks ``[first_block, end_block)`` of every layer, layer-major."""
        return [b for table in seq.block_tables for b in table[first_block:end_block]]

    def allocate(
        self, seq: Sequence, num_new_tokens: int, cached: list[list[int]] | None = None,
        partial: list[list[int]] | None = None,
    ) -> bool:
        """Grow ``seq``'s tables to cover ``num_new_tokens`` more tokens, first adopting the
        ``cached`` prefix (only for a sequence holding no blocks), then the ``partial``
        blocks after it (``[block][layer < k]``: only their upper layers get new blocks;
        ``num_new_tokens`` covers them). False, with ``seq`` unchanged, when the allocator
        cannot supply the blocks."""
        if partial:
            return self._allocate_partial(seq, num_new_tokens, cached or [], partial)
        if cached:
            assert seq.num_blocks == 0 and seq.num_computed_tokens == 0
            flat = [b for blocks in cached for b in blocks]
            self.blocks.touch(flat)  # before allocating, so allocation cannot evict them
            for blocks in cached:
                for layer, b in enumerate(blocks):
                    seq.block_tables[layer].append(b)
            seq.num_computed_tokens = len(cached) * self.block_size
            seq.num_registered_blocks = len(cached)
        need = self.blocks_needed(seq, num_new_tokens)
        new = self.blocks.allocate(need) if need else []
        if new is None:
            if cached:
                self.free(seq)
            return False
        per_layer = need // self.num_layers
        for layer in range(self.num_layers):
            seq.block_tables[layer].extend(new[layer * per_layer : (layer + 1) * per_layer])
        return True

    def _allocate_partial(self, seq: Sequence, num_new_tokens: int,
                          cached: list[list[int]], partial: list[list[int]]) -> bool:
        assert seq.num_blocks == 0 and seq.num_computed_tokens == 0
        k, n_part, n_cached = len(partial[0]), len(partial), len(cached)
        per_layer = -(-(n_cached * self.block_size + num_new_tokens) // self.block_size)
        fresh = per_layer - n_cached  # blocks per layer past the cached prefix
        assert fresh >= n_part, "the tokens to compute must cover the partial blocks"
        held = [b for blocks in cached for b in blocks] + [b for bl in partial for b in bl]
        self.blocks.touch(held)  # before allocating, so allocation cannot evict them
        new = self.blocks.allocate(fresh * self.num_layers - k * n_part)
        if new is None:
            self.blocks.free(reversed(held))
            return False
        at = 0
        for layer in range(self.num_layers):
            table = [blocks[layer] for blocks in cached]
            if layer < k:
                table += [blocks[layer] for blocks in partial]
                take = fresh - n_part
            else:
                take = fresh
            table += new[at : at + take]
            at += take
            seq.block_tables[layer] = table
        seq.num_computed_tokens = n_cached * self.block_size
        seq.num_registered_blocks = n_cached
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """Enter newly completed blocks into the prefix cache (after a step computed them)."""
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_registered_blocks:
            return
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, seq.hash_seed)
        for i in range(seq.num_registered_blocks, full):
            h = seq.block_hashes[i]
            for layer in range(self.num_layers):
                self.blocks.cache(seq.block_tables[layer][i], (h, layer))
        seq.num_registered_blocks = full

    def free(self, seq: Sequence) -> None:
        """Release all of ``seq``'s blocks: later layers first and, within a layer, later
        blocks first, so that is the order they are evicted in."""
        order = [b for table in reversed(seq.block_tables) for b in reversed(table)]
        self.blocks.free(order)
        seq.block_tables = [[] for _ in range(self.num_layers)]
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
