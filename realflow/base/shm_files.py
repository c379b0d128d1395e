"""Named shared-memory files in /dev/shm: create, map, pre-fault, unlink.

Two data planes use them (sample transfers in ``realflow.comm.shm`` and parameter
reallocation in ``parallel.realloc``); this module is the one place that knows how a
segment is made safely: exclusive creation with owner-only permissions, space reserved
up front (a full tmpfs fails here with a clear error, not later with SIGBUS), and page
tables pre-faulted through torch, which releases the GIL (mmap's MAP_POPULATE would hold
it while the kernel faults every page).
"""
from __future__ import annotations

import errno
import mmap
import os

import numpy as np
import torch

__all__ = ["SHM_DIR", "ShmSpaceError", "shm_path", "create_mapped", "open_mapped", "prefault", "unlink_quiet"]

SHM_DIR = "/dev/shm"
_MiB = 1 << 20


class ShmSpaceError(RuntimeError):
    """/dev/shm has no room for the segment; the message says how much is free."""


def shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def prefault(mm: mmap.mmap, write: bool) -> None:
    """Touch one byte per page so later copies do not page-fault (write: also allocate)."""
    view = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
    if write:
        view[:: mmap.PAGESIZE].zero_()
    else:
        view[:: mmap.PAGESIZE].sum()
    del view


def create_mapped(name: str, size: int, populate: bool = True) -> mmap.mmap:
    """Create ``/dev/shm/<name>`` (must not exist) of ``size`` bytes and map it shared."""
    path = shm_path(name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                free = os.statvfs(SHM_DIR)
                raise ShmSpaceError(f"no space in {SHM_DIR} for a {size / _MiB:.1f} MiB segment "
                                    f"({free.f_bavail * free.f_frsize / _MiB:.1f} MiB free)") from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        if populate:
            prefault(mm, write=True)
    except BaseException:
        unlink_quiet(name)
        raise
    finally:
        os.close(fd)
    return mm


def open_mapped(name: str, size: int, populate: bool = True) -> mmap.mmap:
    """Map an existing segment of at least ``size`` bytes (FileNotFoundError if it is gone)."""
    fd = os.open(shm_path(name), os.O_RDWR)
    try:
        actual = os.fstat(fd).st_size
        if actual < size:
            raise ValueError(f"shared-memory segment {name} has {actual} bytes, expected at least {size}")
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    if populate:
        prefault(mm, write=False)
    return mm


def unlink_quiet(name: str) -> bool:
    """Remove the name (mappings stay valid); False if it was already gone."""
    try:
        os.unlink(shm_path(name))
        return True
    except FileNotFoundError:
        return False
