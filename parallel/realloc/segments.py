"""Persistent shared-memory segments for same-host reallocation.

A reallocation runs every training step, so its segments are created once (in
``prepare_reallocation``) and reused: writing into fresh tmpfs pages costs page
faults and zeroing (about 3x a memcpy, see ``realflow.comm.shm.ShmPool``), and a
pre-faulted, already-mapped segment makes each transfer one memcpy on each side.
Names are unlinked as soon as every reader has mapped them, so a crash leaks
nothing (the memory goes with the last mapping).
"""
from __future__ import annotations

import errno
import mmap
import os
from typing import Optional

import numpy as np
import torch


__all__ = ["Segment", "create_segment", "open_segment", "unlink_segment", "SHM_DIR"]

SHM_DIR = "/dev/shm"  # tmpfs; parallel/ may not import realflow.comm (dependency direction)


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


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def create_segment(name: str, size: int) -> Segment:
    """Create, size and pre-fault a segment (one write per page)."""
    fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                os.unlink(_path(name))
                raise RuntimeError(f"no space in {SHM_DIR} for a {size >> 20} MiB reallocation segment") from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    except BaseException:
        unlink_segment(name)
        raise
    finally:
        os.close(fd)
    seg = Segment(name, mm)
    seg.data[:: mmap.PAGESIZE].zero_()  # pre-fault our page tables (torch releases the GIL)
    return seg


def open_segment(name: str, size: int) -> Segment:
    """Map an existing segment of at least ``size`` bytes and pre-fault the reader's page tables."""
    try:
        fd = os.open(_path(name), os.O_RDWR)
    except FileNotFoundError:
        raise RuntimeError(f"reallocation segment {name} not found in {SHM_DIR}") from None
    try:
        actual = os.fstat(fd).st_size
        if actual < size:
            raise RuntimeError(f"reallocation segment {name} has {actual} bytes, expected {size}")
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    seg = Segment(name, mm)
    seg.data[:: mmap.PAGESIZE].sum()
    return seg


def unlink_segment(name: str) -> bool:
    try:
        os.unlink(_path(name))
        return True
    except FileNotFoundError:
        return False
