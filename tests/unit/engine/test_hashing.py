from __future__ import annotations

from shared.hashing import block_hashes, chain_hash, extend_block_hashes, hash_seed


def test_full_blocks_only_and_chained() -> None:
    seed = hash_seed("fp", "tenant")
    hs = block_hashes(list(range(10)), 4, seed)
    assert len(hs) == 2  # tokens 8, 9 form a partial block: no hash
    assert hs[0] == chain_hash(seed, [0, 1, 2, 3])
    assert hs[1] == chain_hash(hs[0], [4, 5, 6, 7])
    assert all(len(h) == 16 for h in hs)


def test_a_different_earlier_block_changes_every_later_hash() -> None:
    seed = hash_seed("fp", "")
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, seed)
    b = block_hashes([1, 2, 3, 9, 5, 6, 7, 8], 4, seed)
    assert a[0] != b[0] and a[1] != b[1]
    c = block_hashes([1, 2, 3, 4, 5, 6, 7, 9], 4, seed)
    assert a[0] == c[0] and a[1] != c[1]


def test_seed_separates_models_and_tenants() -> None:
    toks = [1, 2, 3, 4]
    assert (
        block_hashes(toks, 4, hash_seed("m1", "t"))[0]
        != block_hashes(toks, 4, hash_seed("m2", "t"))[0]
    )
    assert (
        block_hashes(toks, 4, hash_seed("m", "t1"))[0]
        != block_hashes(toks, 4, hash_seed("m", "t2"))[0]
    )


def test_extend_hashes_only_new_blocks() -> None:
    seed = hash_seed("fp", "")
    toks = list(range(13))
    hs = extend_block_hashes([], toks[:5], 4, seed)
    assert len(hs) == 1
    extend_block_hashes(hs, toks, 4, seed)
    assert hs == block_hashes(toks, 4, seed)
