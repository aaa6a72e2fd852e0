"""A token embedding kept quantized: a lookup dequantizes only the rows it reads.

With tied embeddings the same codes are also the output head's weight; the head is a
kernel-packed copy (``build.make_linear``), about half the size of the table again in int4,
where a float32 head would be eight times it.
"""

from __future__ import annotations

import torch

from .ggml_blocks import Int4Groups, Int8Groups
from .stored import pack_nibbles, unpack_nibbles


class QuantEmbedding:
    """(vocab, hidden) embedding as 4-bit codes (nibble-packed) or int8 codes, with their
    group scales; ``lookup`` returns rows in ``dtype``."""

    __slots__ = ("codes", "dtype", "group", "low", "scale")

    def __init__(self, q: Int4Groups | Int8Groups, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.group = q.group
        self.scale = q.scale.float()
        if isinstance(q, Int4Groups):
            self.codes = pack_nibbles(q.codes)
            self.low: torch.Tensor | None = q.min.float()
        else:
            self.codes, self.low = q.codes, None

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.codes.shape
        return rows, cols * 2 if self.low is not None else cols

    @property
    def weight_bytes(self) -> int:
        ts = (self.codes, self.scale, self.low)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def groups(self) -> Int4Groups | Int8Groups:
        """The whole table as codes and scales (for a tied head)."""
        if self.low is not None:
            return Int4Groups(unpack_nibbles(self.codes), self.scale, self.low, self.group)
        return Int8Groups(self.codes, self.scale, self.group)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (T,) -> (T, hidden) in ``dtype``."""
        scale = self.scale[ids]
        if self.low is not None:
            q: Int4Groups | Int8Groups = Int4Groups(unpack_nibbles(self.codes[ids]), scale,
                                                    self.low[ids], self.group)
        else:
            q = Int8Groups(self.codes[ids], scale, self.group)
        return q.dequantize().to(self.dtype)
