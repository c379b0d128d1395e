"""The contiguous decode path's per-row KV slots (:class:`KVCache`): the CPU's attention memory.

Beside the paged pool (:mod:`parallel.generation.paged_cache`, what blocks, sharing and the
prefix cache live in) the contiguous path keeps each running row's keys and values in one slot,
so that decode attends over plain views with no gather per step (see
:mod:`parallel.generation.stepping`).
"""
from __future__ import annotations

import torch

from parallel.generation.host_memory import kv_zeros
from parallel.generation.weights import ModelSpec

__all__ = ["KVCache"]


class KVCache:
    """Keys and values per layer and slot, ``k``, ``v`` ``[layers, slots, local kv heads,
    capacity, head_dim]``, grown along positions as rows get longer (up to ``max_len``).

    Row ``i`` of the running batch always lives in slot ``i`` (the engine keeps the batch
    compact by moving the last row into a freed slot), so attention reads plain views
    ``k[l, :B, :, :L]``: no gather.

    Why the capacity follows the longest running row instead of being ``max_len`` from the
    start: a decode step writes one ``head_dim`` row per (slot, head) and attention reads
    each slot's first ``L`` rows, so the step touches memory at a stride of ``capacity *
    head_dim``.  At ``max_len`` that is a page or more per (slot, head): on CPU (and worse in
    a VM, where a TLB miss walks two page tables) the scattered touches cost more than the
    attention's arithmetic.  :meth:`reserve` doubles the capacity when a row needs more (one
    copy of the live slots, ``log2(max_len)`` times at most).

    When no row runs (a new batch starts) the capacity shrinks only if the last busy period
    used less than half of it: a batch like the last one then starts at the capacity it will
    need, with no regrowth.  Why: each growth writes fresh memory (page faults, zeroing), and
    on the default RL workload (256 rows growing to 128 positions) growing back from 16 every
    batch cost ~12% of the batch; a fixed large capacity instead cost ~16% on short batches
    (the stride above).

    Why keys are not kept transposed (``[head_dim, L]``, contiguous columns for ``q @ K^T``):
    the step would then write each new key as ``head_dim`` scattered elements, which cost
    ~10x the write of whole rows, while the matmul over a transposed view is only 0-40%
    slower at decode's shapes (1-thread bmm).
    """

    MIN_CAPACITY = 16

    def __init__(self, spec: ModelSpec, slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.slots, self.max_len = slots, max_len
        self.groups, self.head_dim, self.layers = spec.local_groups, spec.head_dim, spec.num_layers
        self.dtype, self.device = dtype, device
        self._peak = 0  # the longest length reserved since the last batch started
        self._starting = False  # a new batch's capacity was decided, and no row decoded since
        self._alloc(min(max_len, self.MIN_CAPACITY))

    def _alloc(self, capacity: int) -> None:
        shape = (self.layers, self.slots, self.groups, capacity, self.head_dim)
        # zeros, not empty: masked positions still meet the values in softmax(scores) @ V, and
        # 0 * NaN from uninitialised memory would be NaN
        self.k = kv_zeros(shape, self.dtype, self.device)
        self.v = kv_zeros(shape, self.dtype, self.device)
        self.capacity = capacity
        # flat per-layer views for decode's index_copy_ writes: one row per (slot, group, pos)
        self.k_flat = [t.view(-1, self.head_dim) for t in self.k]
        self.v_flat = [t.view(-1, self.head_dim) for t in self.v]
        # flat row of position 0 of every (slot, group): decode adds the positions
        self._base = torch.arange(self.slots * self.groups, device=self.device) * capacity

    def reserve(self, length: int, live: int) -> None:
        """Room for positions ``0..length-1``, keeping slots ``0..live-1``' contents.

        With no live slot (a new batch), a capacity over twice what both the last busy period
        and this batch need is also given back."""
        if length > self.max_len:
            raise ValueError(f"KV cache: position {length - 1} is past max_len {self.max_len}")
        if live or self._starting:  # (every layer's prefix write of a new batch reserves again)
            if live:
                self._starting = False
            self._peak = max(self._peak, length)
            if length <= self.capacity:
                return
            need = length
        else:  # a new batch: decided once, from the last busy period's peak
            need, self._peak, self._starting = max(self._peak, length, self.MIN_CAPACITY), length, True
            if length <= self.capacity <= 2 * need:
                return
        cap = self.MIN_CAPACITY
        while cap < need:
            cap *= 2
        old_k, old_v, old_cap = self.k, self.v, self.capacity
        if not live:  # nothing to keep: the old tensors (and their flat views) go before the new ones come
            del old_k, old_v
            self.k = self.v = torch.empty(0, dtype=self.dtype, device=self.device)
            self.k_flat = self.v_flat = []
        self._alloc(min(cap, self.max_len))
        if live:
            n = min(old_cap, self.capacity)
            self.k[:, :live, :, :n] = old_k[:, :live, :, :n]
            self.v[:, :live, :, :n] = old_v[:, :live, :, :n]

    def write_prefix(self, layer: int, slot0: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Prefill: ``k``/``v`` ``[J, groups, P, head_dim]`` into slots ``slot0..slot0+J-1``
        (the slots before ``slot0`` are kept)."""
        J, _, P, _ = k.shape
        self.reserve(P, slot0)
        self.k[layer, slot0:slot0 + J, :, :P] = k
        self.v[layer, slot0:slot0 + J, :, :P] = v

    def write_prefix_repeated(self, layer: int, slot0: int, k: torch.Tensor, v: torch.Tensor, repeat: int) -> None:
        """Prefill of a request's n samples: job ``j``'s ``k``/``v`` ``[J, groups, P, head_dim]``
        into slots ``slot0 + j*repeat .. slot0 + (j+1)*repeat - 1``, as one broadcast copy (no
        ``[J*repeat, ...]`` intermediate: ~2x cheaper, and no fresh memory to fault in)."""
        J, G, P, D = k.shape
        self.reserve(P, slot0)
        rows = slice(slot0, slot0 + J * repeat)
        self.k[layer, rows, :, :P].view(J, repeat, G, P, D).copy_(k[:, None])
        self.v[layer, rows, :, :P].view(J, repeat, G, P, D).copy_(v[:, None])

    def fill_from_jobs(self, layer: int, slot0: int, k: torch.Tensor, v: torch.Tensor,
                       src: torch.Tensor | int) -> None:
        """Slots ``slot0..`` from prefill jobs' ``k``/``v`` ``[jobs, groups, P, head_dim]``: slot
        ``slot0 + i`` from job ``src[i]``, or (``src`` an int ``n``) each job into the next n slots."""
        if isinstance(src, int):
            self.write_prefix_repeated(layer, slot0, k, v, src)
        else:
            self.write_prefix(layer, slot0, k.index_select(0, src), v.index_select(0, src))

    def decode_index(self, pos: torch.Tensor) -> torch.Tensor:
        """Flat write rows ``[B*groups]`` for one new position per row (rows = slots ``0..B-1``),
        computed once per step and shared by every layer and by keys and values."""
        n = pos.shape[0] * self.groups
        return self._base[:n].add(pos[:, None].expand(-1, self.groups).reshape(n))

    def read_spans(self, rows: list[int], starts: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``starts[j] .. starts[j]+length-1`` of slot ``rows[j]``,
        every layer, as ``[layers, len(rows)*length, groups, head_dim]`` each (the pool's row
        layout): one ``index_select`` per tensor on the flat (slot, group, position) rows (mixed
        advanced indexing measured ~1.5x this)."""
        dev, G = self.device, self.groups
        pos = torch.tensor(starts, device=dev)[:, None] + torch.arange(length, device=dev)  # [R, length]
        slot_group = torch.tensor(rows, device=dev)[:, None] * G + torch.arange(G, device=dev)  # [R, G]
        flat = (slot_group[:, None, :] * self.capacity + pos[:, :, None]).flatten()  # [R*length*G]
        return tuple(t.view(self.layers, -1, self.head_dim).index_select(1, flat).view(self.layers, -1, G, self.head_dim)
                     for t in (self.k, self.v))  # type: ignore[return-value]

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Copy slots ``src``' first ``length`` positions into slots ``dst`` (disjoint)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` positions into slot ``dst``."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    @property
    def nbytes(self) -> int:
        """Bytes it holds now (it grows up to ``max_len`` positions; see :meth:`max_nbytes`)."""
        return self._bytes(self.capacity)

    @property
    def max_nbytes(self) -> int:
        return self._bytes(self.max_len)

    def _bytes(self, capacity: int) -> int:
        # plain arithmetic, no tensor: stats are read from other threads while reserve() swaps them
        per_position = 2 * self.layers * self.slots * self.groups * self.head_dim
        return per_position * capacity * self.dtype.itemsize
