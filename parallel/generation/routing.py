"""The routing record of an MoE model's sequences: which experts each input token went to.

Rollout routing replay (R3) trains an MoE policy on the experts the GENERATOR chose, so the
trainer's forward takes the routing from the rollout instead of re-deciding it (a near-tie
flips an expert between two engines and the two policies differ by far more than rounding).
The engine therefore keeps, per sequence, the top-k global expert ids of every token it ran as
input: row ``t`` of ``[len(prompt) + len(output) - 1, layers, topk]`` is the token at position
``t`` (the last generated token is never an input, hence the ``- 1``; SGLang's
``return_routed_experts`` has the same rows).

A re-prefill after a weight update or a retraction recomputes rows ``0..n-1`` under the new
weights and overwrites them: the record always describes the KV cache the output was sampled
from, segment by segment, like the per-token weight versions.

Memory: one numpy buffer per recording sequence, of :func:`parallel.generation.moe.routing_dtype`
(1 byte per id up to 256 experts), grown by doubling; no per-token Python objects.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

__all__ = ["RoutingBuffer", "new_buffer", "record_prefill", "record_decode"]


class RoutingBuffer:
    """Rows ``[0, n)`` of one sequence's routing record (``[rows, layers, topk]``)."""

    __slots__ = ("buf", "n")

    def __init__(self, layers: int, topk: int, dtype: np.dtype, capacity: int = 64) -> None:
        self.buf = np.empty((max(capacity, 1), layers, topk), dtype=dtype)
        self.n = 0

    def write(self, start: int, rows: np.ndarray) -> None:
        """Rows ``start..start+len(rows)-1``; the record ends there (later rows are stale)."""
        end = start + rows.shape[0]
        if end > self.buf.shape[0]:
            grown = np.empty((max(end, 2 * self.buf.shape[0]), *self.buf.shape[1:]), dtype=self.buf.dtype)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        self.buf[start:end] = rows
        self.n = end

    def array(self) -> np.ndarray:
        """A copy of the record (what a result carries; the buffer may be reused)."""
        return self.buf[: self.n].copy()


def new_buffer(routing_dtype: torch.dtype, layers: int, topk: int, capacity: int) -> RoutingBuffer:
    """A buffer of the decoder's routing dtype, sized for ``capacity`` rows at first."""
    return RoutingBuffer(layers, topk, torch.empty((), dtype=routing_dtype).numpy().dtype, capacity)


def record_prefill(buffers: Sequence[Optional[RoutingBuffer]], routing: torch.Tensor,
                   lens: Sequence[int], starts: Optional[Sequence[int]] = None) -> None:
    """A prefill's routing ``[J, P, layers, k]`` into the buffers of its ``J`` rows (None: not
    recorded); row ``i`` ran positions ``starts[i] .. starts[i] + lens[i] - 1`` (a chunk)."""
    if not any(b is not None for b in buffers):
        return
    arr = routing.cpu().numpy()
    for i, b in enumerate(buffers):
        if b is not None:
            b.write(0 if starts is None else starts[i], arr[i, : lens[i]])


def record_decode(buffers: Sequence[Optional[RoutingBuffer]], routing: torch.Tensor,
                  positions: Sequence[int]) -> None:
    """A decode step's routing ``[B, layers, k]``: row ``i`` is the token fed at ``positions[i]``."""
    if not any(b is not None for b in buffers):
        return
    arr = routing.cpu().numpy()
    for i, b in enumerate(buffers):
        if b is not None:
            b.write(positions[i], arr[i: i + 1])
