"""Zeroed tensors for the KV memory of a CPU engine, backed by transparent huge pages where the OS allows.

Why: the KV pool and the per-row slots are tens to hundreds of MB that a decode step touches at
thousands of scattered places (a new key per row and head, each row's context).  With 4 KB pages
each touch is likely a TLB miss, and in a VM a miss walks two page tables.  Backing the tensors
with 2 MB pages (``madvise(MADV_HUGEPAGE)`` on a 2 MB-aligned range, honoured when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``) cut the decode
step's KV writes by ~40% on the CI machine (1-thread microbenchmark, 512 rows).  Elsewhere
(no Linux, no THP, another device) this is plain ``torch.zeros``.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Optional

import torch

__all__ = ["kv_zeros"]

_HUGE = 2 << 20  # bytes per huge page (x86-64, arm64 with 4 KB base pages)
_MADV_HUGEPAGE = 14


@functools.lru_cache(maxsize=1)
def _madvise() -> Optional[ctypes._CFuncPtr]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(shape)``; on a Linux CPU, of at least one huge page, in huge-page-backed memory."""
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    madvise = _madvise() if device.type == "cpu" else None
    if madvise is None or nbytes < _HUGE:
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.empty(nbytes + _HUGE, dtype=torch.uint8)  # untouched: no page is faulted in yet
    start = (-raw.data_ptr()) % _HUGE
    buf = raw[start:start + nbytes]
    madvise(buf.data_ptr(), nbytes - nbytes % _HUGE, _MADV_HUGEPAGE)  # a refusal leaves 4 KB pages: fine
    return buf.view(dtype).view(shape).zero_()  # the first touch, after the advice
