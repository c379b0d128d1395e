"""The KV pool: every layer's keys and values in ``block_size``-token blocks.

``k[layer]`` and ``v[layer]`` are ``[num_blocks * block_size + 1, local kv heads, head_dim]``:
token ``t`` of a sequence whose block table is ``table`` lives in row
``table[t // block_size] * block_size + t % block_size``. The extra last row is a scratch row
that padded positions write into (and masked positions read), so a batch of ragged rows is one
``index_copy_`` / ``index_select`` with no branches.

Attention reads the pool in one of three ways (``decode_attention``; :class:`parallel.generation.decoder.Decoder`):

* ``paged`` (the GPU's) -- each row attends over its blocks in place, through the Triton kernel
  of :mod:`parallel.generation.paged_attention`;
* ``gather`` (``paged`` without Triton) -- each row's context is gathered by its block table into
  a new tensor, then attended over: a copy of every row's keys and values per layer and step;
* ``contiguous`` (CPU's default) -- a per-row contiguous copy of the block tables' contents
  (:class:`parallel.generation.kv_slots.KVCache`, one slot per running row) kept up to date as
  tokens are written: a row's context is copied once when it joins, and decode reads plain views.
  Measured on this CPU (512 rows x 64 positions, 2 kv heads of 32): the gather costs ~8x the
  attention it feeds; the copy doubles the KV memory, which a CPU host has.
"""
from __future__ import annotations

from typing import Sequence

import torch

from parallel.generation.host_memory import kv_zeros
from parallel.generation.weights import ModelSpec

__all__ = ["PagedKVCache", "block_bytes"]


def block_bytes(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block's keys and values over every layer (this tp rank's kv heads)."""
    per = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * spec.local_groups * spec.head_dim * block_size * per


class PagedKVCache:
    """The pool's tensors and the index arithmetic (block bookkeeping: :mod:`parallel.generation.blocks`)."""

    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        rows = num_blocks * block_size + 1
        shape = (spec.num_layers, rows, spec.local_groups, spec.head_dim)
        self.k = kv_zeros(shape, dtype, device)
        self.v = kv_zeros(shape, dtype, device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch = rows - 1  # the row padded positions write to
        self.device = device

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    # ------------------------------------------------------------ indices

    def rows_at(self, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pool rows of token ``positions`` through block ``tables [J, W]``: ``positions [P]`` (the
        same for every row) gives ``[J, P]``; ``positions [J, P]`` (each row its own) too."""
        bs = self.block_size
        if positions.dim() == 1:
            return tables[:, positions // bs] * bs + positions % bs
        return tables.gather(1, positions // bs) * bs + positions % bs

    def index(self, tables: Sequence[Sequence[int]], starts: Sequence[int], ends: Sequence[int],
              width: int) -> torch.Tensor:
        """``[rows, width]`` pool rows of each row's tokens ``start..end-1`` (then the scratch row)."""
        W = max(1, max(len(t) for t in tables))
        table = torch.tensor([list(t) + [0] * (W - len(t)) for t in tables], dtype=torch.long, device=self.device)
        a = torch.tensor(starts, dtype=torch.long, device=self.device)[:, None]
        b = torch.tensor(ends, dtype=torch.long, device=self.device)[:, None]
        pos = a + torch.arange(width, device=self.device)[None, :]
        inside = pos < b
        rows = self.rows_at(table, torch.where(inside, pos, a))  # (a is in the table; masked below)
        return rows.masked_fill_(~inside, self.scratch)

    # ------------------------------------------------------------ contents

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys / values ``[N, groups, head_dim]`` into pool rows ``rows [N]``."""
        self.k[layer].index_copy_(0, rows, k)
        self.v[layer].index_copy_(0, rows, v)

    def read(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at pool rows ``rows [J, C]``: ``[J, C, groups, head_dim]`` each."""
        flat = rows.reshape(-1)
        shape = (*rows.shape, self.k.shape[2], self.k.shape[3])
        return self.k[layer].index_select(0, flat).view(shape), self.v[layer].index_select(0, flat).view(shape)

    def read_blocks(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of whole blocks ``tables [J, W]``: ``[J, W * block_size, groups,
        head_dim]`` each (token ``t`` of row ``j`` at ``[j, t]``). One index per block, not per
        token: ~``block_size`` x fewer, contiguous, copies than :meth:`read`."""
        bs, J, W = self.block_size, *tables.shape
        blocks = self.k.shape[1] // bs  # (the scratch row is past the last whole block)
        flat = tables.reshape(-1)
        out = []
        for t in (self.k[layer], self.v[layer]):
            whole = t[: blocks * bs].view(blocks, bs, *t.shape[1:])
            out.append(whole.index_select(0, flat).view(J, W * bs, *t.shape[1:]))
        return out[0], out[1]

    def copy_block(self, src: int, dst: int) -> None:
        """Block ``src``'s contents into block ``dst``, every layer (copy-on-write)."""
        bs = self.block_size
        self.k[:, dst * bs:(dst + 1) * bs] = self.k[:, src * bs:(src + 1) * bs]
        self.v[:, dst * bs:(dst + 1) * bs] = self.v[:, src * bs:(src + 1) * bs]
