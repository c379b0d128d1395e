"""Reused buffers for the decode step's large intermediates (CPU only).

Why: a decode step at a few hundred rows makes a dozen fresh activations per layer of
0.3-1.5 MB each.  glibc serves those from fresh pages (``mmap`` above its threshold, or
a heap trimmed back after each free), so every one of them page-faults on first touch,
and in a VM a fault costs a trip through the hypervisor.  Measured on the CI machine
(a 2-core VM) at 512 rows: the MLP's ``[B, 2*ffn]`` matmul took ~1.1 ms with a fresh
output and ~0.7 ms writing into a reused one.  Reusing one buffer per role across the
layers and the steps also keeps the step's working set small enough to stay in cache.

On CUDA the caching allocator already reuses blocks (and CUDA graphs pin their own
memory), so :func:`workspace_for` gives ``None`` there and the ops allocate as usual.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["Workspace", "workspace_for"]


class Workspace:
    """Named flat buffers, grown to the largest request and handed out as views."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, *shape: int) -> torch.Tensor:
        """A ``shape`` view of buffer ``name``: its contents are whatever the last user left.

        A caller owns the view until it asks for the same ``name`` again."""
        n = 1
        for d in shape:
            n *= d
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n:
            buf = self._bufs[name] = torch.empty(n, dtype=self.dtype, device=self.device)
        return buf[:n].view(shape)


def workspace_for(dtype: torch.dtype, device: torch.device) -> Optional[Workspace]:
    return Workspace(dtype, device) if device.type == "cpu" else None
