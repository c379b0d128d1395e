"""Persistent shared-memory segments for same-host reallocation.

A reallocation runs every training step, so its segments are created once (in
``prepare_reallocation``) and reused: writing into fresh tmpfs pages costs page
faults and zeroing (about 3x a memcpy, see ``realflow.comm.shm.ShmPool``), and a
pre-faulted, already-mapped segment makes each transfer one memcpy on each side.
Names are unlinked as soon as every reader has mapped them, so a crash leaks
nothing (the memory goes with the last mapping).
"""
from __future__ import annotations

import mmap
from typing import Optional

import numpy as np
import torch

from realflow.base.shm_files import SHM_DIR, ShmSpaceError, create_mapped, open_mapped, unlink_quiet

__all__ = ["Segment", "create_segment", "open_segment", "unlink_segment", "SHM_DIR"]



class Segment:
    """A mapped segment and a uint8 tensor view of it."""

    def __init__(self, name: str, mm: mmap.mmap) -> None:
        self.name = name
        self._mm: Optional[mmap.mmap] = mm
        self.data = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))

    @property
    def size(self) -> int:
        return int(self.data.numel())

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self.data[offset:offset + n].view(dtype).view(shape)

    def close(self) -> None:
        """Drop the mapping (views handed out keep it alive until they die)."""
        self.data = torch.empty(0, dtype=torch.uint8)
        self._mm = None


def create_segment(name: str, size: int) -> Segment:
    """Create, size and pre-fault a segment (one write per page)."""
    try:
        return Segment(name, create_mapped(name, size))
    except ShmSpaceError as e:
        raise RuntimeError(f"reallocation segment: {e}") from None


def open_segment(name: str, size: int) -> Segment:
    """Map an existing segment of at least ``size`` bytes and pre-fault the reader's page tables."""
    try:
        return Segment(name, open_mapped(name, size))
    except FileNotFoundError:
        raise RuntimeError(f"reallocation segment {name} not found in {SHM_DIR}") from None
    except ValueError as e:
        raise RuntimeError(f"reallocation {e}") from None


def unlink_segment(name: str) -> bool:
    return unlink_quiet(name)
