"""CUDA graphs for the paged decode step: a step's hundreds of small kernels launched as one.

Why: on a GPU a small model's decode step is launch-bound (the built-in engine measured ~0.7 ms
per layer per step on an H200, far above what its bytes cost). A graph replays the whole step's
kernels at once; what changes between steps must then live in STATIC buffers the graph was
captured on, and every shape must be fixed. So:

* rows are padded to a bucket (1, 2, 4, ... ``max_rows``); padded rows read block 0 and write
  the pool's scratch row, and their logits are dropped;
* the context is padded to a bucket of positions (a power of two of blocks, up to the longest
  sequence); positions past a row's own are masked, as in the eager step.  With the paged
  attention kernel (:mod:`parallel.generation.paged_attention`), which reads each row's length
  from a tensor, every graph takes the whole table: one graph per row bucket;
* one graph per (row bucket, context bucket), captured the first time it is needed (after one
  warm-up run on a side stream, as torch requires), replayed after; all share one memory pool
  (they never run at once, and a step reads its logits before the next replay).

Weights are updated in place, so graphs stay valid across weight updates; a staged update swaps
the weight tensors for new ones, and storage that moved (a colocated trainer's offload and
reload) is seen at the next weight update: either way the graphs captured on the old pointers
are dropped.

Without CUDA (or with ``capture=False``) :class:`DecodeGraphs` runs the very same static-buffer
code eagerly: CI covers the padding, bucketing and masking logic that the graphs replay.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["DecodeGraphs", "bucket"]


def bucket(n: int, cap: int) -> int:
    """The smallest power of two >= ``n``, at most ``cap``."""
    b = 1
    while b < n:
        b *= 2
    return min(b, cap)


class DecodeGraphs:
    """Static buffers and captured graphs of :meth:`parallel.generation.decoder.Decoder.decode`
    on the paged pool (text models, tp = 1)."""

    def __init__(self, decoder: Any, pool: Any, max_rows: int, table_width: int, capture: bool) -> None:
        dev = pool.device
        self.decoder, self.pool = decoder, pool
        self.max_rows, self.width, self.bs = max_rows, table_width, pool.block_size
        self.capture = capture and dev.type == "cuda"
        self.tokens = torch.zeros(max_rows, dtype=torch.long, device=dev)
        self.pos = torch.zeros(max_rows, dtype=torch.long, device=dev)
        self.tables = torch.zeros((max_rows, table_width), dtype=torch.long, device=dev)
        self.write_rows = torch.full((max_rows,), pool.scratch, dtype=torch.long, device=dev)
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self._weights_id = id(decoder.w)
        self._weight_ptrs = self._ptrs()
        self._pool: Any = None  # the graphs' shared memory pool (they replay one at a time)
        self.captured = 0  # graphs captured so far (stats)

    def run(self, tokens: torch.Tensor, pos: torch.Tensor, tables: torch.Tensor,
            write_rows: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` of one decode step of ``B`` rows (their block tables ``tables [B, W]``)."""
        B = tokens.shape[0]
        rows = bucket(B, self.max_rows)
        # the kernel walks each row's own blocks: one graph per row bucket covers every context
        blocks = self.width if self.decoder.paged_kernel is not None else \
            bucket(int(pos.max()) // self.bs + 1, self.width)
        self.tokens[:B].copy_(tokens)
        self.pos[:B].copy_(pos)
        self.tables[:B].copy_(tables)
        self.write_rows[:B].copy_(write_rows)
        if rows > B:  # padding rows: position 0, block 0 read (masked to one key), the scratch row written
            self.tokens[B:rows].zero_()
            self.pos[B:rows].zero_()
            self.tables[B:rows].zero_()
            self.write_rows[B:rows].fill_(self.pool.scratch)
        if not self.capture:
            return self._forward(rows, blocks)[:B]
        if id(self.decoder.w) != self._weights_id:  # staged weights swapped in: new tensors
            self._graphs.clear()
            self._weights_id = id(self.decoder.w)
            self._weight_ptrs = self._ptrs()
        key = (rows, blocks)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(rows, blocks)
        graph, logits = entry
        graph.replay()
        return logits[:B]

    def _forward(self, rows: int, blocks: int) -> torch.Tensor:
        return self.decoder.decode(self.tokens[:rows], self.pos[:rows], None, None, self.pool,
                                   self.write_rows[:rows], self.tables[:rows, :blocks])

    def _capture(self, rows: int, blocks: int) -> tuple[Any, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (allocator, lazy inits) outside the graph
            self._forward(rows, blocks)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):  # one memory pool for every bucket's graph
            logits = self._forward(rows, blocks)
        self.captured += 1
        return graph, logits

    def _ptrs(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.decoder.w.tensors.values())

    def check_weights(self) -> None:
        """Drop the graphs when a weight tensor's storage moved (they replay raw pointers); an
        in-place update keeps them."""
        ptrs = self._ptrs()
        if ptrs != self._weight_ptrs:
            self._graphs.clear()
            self._weight_ptrs = ptrs

    def stats(self) -> dict[str, float]:
        return {"cuda_graphs": float(len(self._graphs))}


def decode_graphs_for(engine: Any) -> Optional[DecodeGraphs]:
    """Graphs for ``engine`` when it decodes on the paged pool on a GPU, a text model at tp = 1,
    and ``enforce_eager`` is off; None otherwise (the eager step)."""
    cfg = engine.config
    eligible = (engine.cache is None and engine.pool.device.type == "cuda" and not cfg.enforce_eager
                and engine.vision is None and engine.spec.arch.moe is None and engine.spec.tp_size == 1)
    if not eligible:
        return None
    return DecodeGraphs(engine.decoder, engine.pool, cfg.max_running_requests, engine._tables.shape[1], capture=True)
