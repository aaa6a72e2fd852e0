"""Across nodes: a session's KV follows it to whichever node serves its next turn.

    node B (serving)                               node A (served the last turn)
    LookupPrefix(peer=A) ─ local tiers ─┐
                                        ├─FindPrefix──► waits for A's save in flight, leases
                                        │◄── chunks + lease ─┘
                                        ├─GetChunks(keys, lease)──► layer 0, then 1, ...
    LoadIntoPool ◄── layer by layer ────┘   (each chunk verified, kept in B's DRAM)

``links.py`` keeps one channel and a measured bandwidth per peer, ``find.py`` asks a peer
(and answers one), ``data_plane.py`` serves chunk bytes to peers over plain TCP,
``fetch.py`` streams a leased prefix in, lowest layer first
(``engine_path/peer_load.py`` reads it into the pool's blocks). ``pull.py`` copies a whole
session from a peer into this node's tiers (``PullSession``).
"""
