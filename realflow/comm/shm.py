"""Same-host data plane: move a dict of tensors between processes through POSIX shared memory.

Why: sample tensors go worker to worker, never through the master. On one host
the cheapest path is one memcpy into a shared segment by the producer and a
zero-copy mapping by the consumer; only a small msgpack-able *handle* travels on
the control plane.

Lifecycle (nothing leaks, even if a process dies)::

    producer: handle = put_tensors({...})      # creates /dev/shm/<prefix><pid>_<n>_<rand>, writes, unmaps
    control plane carries the handle (a plain dict)
    consumer: tensors = take_tensors(handle)   # maps the segment and unlinks its name at once

After ``take_tensors`` the segment has no name any more: its memory lives exactly
as long as the consumer's tensors (the mapping is owned by them) and the kernel
frees it when they are gone or the consumer dies. A segment that was put but never
taken (consumer died first) is removed by the producer with :func:`release`, or at
teardown/crash-recovery by :func:`cleanup_segments` with the experiment's prefix.

Uses ``os`` + ``mmap`` directly (no ``multiprocessing.shared_memory``, hence no
resource-tracker warnings). Space is reserved with ``posix_fallocate`` so a full
/dev/shm is a clear error instead of a SIGBUS while writing.

Fresh tmpfs pages cost a page fault and zeroing on first touch: measured, writing
64 MiB into a fresh segment takes ~3x a memcpy into resident memory. ``ShmPool``
keeps pre-faulted segments ready (refilled in a background thread), which brings
``put_tensors`` back to memcpy speed. ``benchmarks/bench_transfer.py`` measures both.
"""
from __future__ import annotations

import atexit
import itertools
import logging
import math
import mmap
import os
import queue
import re
import secrets
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from realflow.base.procfs import pid_alive
from realflow.base import shm_files
from realflow.base.shm_files import ShmSpaceError, create_mapped, open_mapped
from realflow.comm.codec import dtype_from_name, dtype_name, tensor_bytes

__all__ = ["put_tensors", "take_tensors", "release", "cleanup_segments", "list_segments", "segment_prefix",
           "ShmPool", "ShmError", "SHM_DIR", "DEFAULT_PREFIX"]

logger = logging.getLogger(__name__)

SHM_DIR = shm_files.SHM_DIR
DEFAULT_PREFIX = "realflow_"
_ALIGN = 64  # every tensor starts on a cache line
_MiB = 1 << 20
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
_counter = itertools.count()


class ShmError(RuntimeError):
    """A shared-memory transfer failed (segment missing, too small, no space...)."""


def segment_prefix(experiment: str, trial: str) -> str:
    """The segment-name prefix of one experiment trial (what crash cleanup removes)."""
    clean = re.sub(r"[^A-Za-z0-9.\-]+", "-", f"{experiment}_{trial}")
    return f"{DEFAULT_PREFIX}{clean}_"


def _check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or len(prefix) < 4 or not _SAFE_NAME.match(prefix):
        raise ValueError(f"shm prefix must be >= 4 characters of [A-Za-z0-9_.-], got {prefix!r}")
    return prefix


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


@dataclass
class _Segment:
    name: str
    size: int
    mm: mmap.mmap  # the producer's mapping, closed after writing


def _create_segment(prefix: str, size: int, populate: bool) -> _Segment:
    name = f"{prefix}{os.getpid()}_{next(_counter)}_{secrets.token_hex(4)}"
    try:
        return _Segment(name, size, create_mapped(name, size, populate))
    except ShmSpaceError as e:
        raise ShmError(str(e)) from None


def _layout(tensors: Mapping[str, torch.Tensor]) -> tuple[list[tuple[str, torch.Tensor, int, int]], int]:
    if not isinstance(tensors, Mapping):
        raise TypeError(f"put_tensors expects a dict of name -> torch.Tensor, got {type(tensors).__name__}")
    items, offset = [], 0
    for key, t in tensors.items():
        if not isinstance(key, str):
            raise TypeError(f"put_tensors: key {key!r} is not a str")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"put_tensors: value of {key!r} is {type(t).__name__}, not a torch.Tensor")
        try:
            t, _ = tensor_bytes(t)
            dtype_name(t.dtype)
        except Exception as e:
            raise TypeError(f"put_tensors: tensor {key!r} cannot be shared: {e}") from None
        nbytes = t.numel() * t.element_size()
        offset = -(-offset // _ALIGN) * _ALIGN
        items.append((key, t, offset, nbytes))
        offset += nbytes
    return items, offset


def put_tensors(tensors: Mapping[str, torch.Tensor], *, prefix: str = DEFAULT_PREFIX,
                pool: "ShmPool | None" = None) -> dict:
    """Copy ``tensors`` into one new shared-memory segment and return its msgpack-able handle.

    Non-contiguous tensors are made contiguous, CUDA tensors copied to CPU; dtypes and
    shapes are preserved exactly. With ``pool`` a pre-faulted segment is used when one fits.
    """
    items, total = _layout(tensors)
    handle: dict[str, Any] = {"v": 1, "segment": None, "size": 0, "pid": os.getpid(), "tensors": {
        key: {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": off, "nbytes": n}
        for key, t, off, n in items}}
    if total == 0:
        return handle
    seg = pool.acquire(total) if pool is not None else None
    if seg is None:
        seg = _create_segment(_check_prefix(prefix if pool is None else pool.prefix), total, populate=False)
    try:
        arr = np.frombuffer(seg.mm, dtype=np.uint8)
        for _key, t, off, n in items:
            if n:
                torch.from_numpy(arr[off:off + n]).copy_(t.reshape(-1).view(torch.uint8))
        del arr
    except BaseException:
        _unlink_quiet(seg.name)
        raise
    finally:
        try:
            seg.mm.close()
        except BufferError:  # a view survived an exception; the mapping goes with it
            pass
    handle["segment"] = seg.name
    handle["size"] = seg.size
    if pool is not None:
        pool.refill(total)
    return handle


def _check_handle(handle: Any) -> tuple[str | None, int, dict]:
    try:
        name, size, specs = handle["segment"], int(handle["size"]), handle["tensors"]
        if name is not None and (not isinstance(name, str) or not _SAFE_NAME.match(name)):
            raise ValueError(f"bad segment name {name!r}")
        for key, s in specs.items():
            end = int(s["offset"]) + int(s["nbytes"])
            want = math.prod(s["shape"]) * dtype_from_name(s["dtype"]).itemsize
            if int(s["nbytes"]) != want or int(s["offset"]) < 0 or end > size:
                raise ValueError(f"tensor {key!r}: {s} does not fit a {size}-byte segment")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ShmError(f"malformed shm handle: {e}") from None
    return name, size, specs


def take_tensors(handle: Mapping[str, Any], copy: bool = False, *, unlink: bool = True) -> dict[str, torch.Tensor]:
    """Map the segment of ``handle`` and return its tensors.

    ``copy=False``: the tensors alias the shared memory (zero copy); the mapping lives as
    long as any of them. ``unlink=True`` removes the segment's name right after mapping,
    so the memory is freed with the tensors even if this process dies; pass False only
    when several consumers map the same handle (the last one must unlink or ``release``).
    """
    name, size, specs = _check_handle(handle)
    if name is None:
        return {k: torch.empty(s["shape"], dtype=dtype_from_name(s["dtype"])) for k, s in specs.items()}
    try:
        mm = open_mapped(name, size, populate=False)
    except FileNotFoundError:
        raise ShmError(f"shared-memory segment {name!r} not found: already taken by a consumer, released by its "
                       f"producer (pid {handle.get('pid')}), or cleaned up") from None
    except ValueError as e:
        raise ShmError(f"{e} (from the handle)") from None
    finally:
        if unlink:
            _unlink_quiet(name)
    arr = np.frombuffer(mm, dtype=np.uint8)  # holds a buffer export: the mapping cannot be closed under us
    out: dict[str, torch.Tensor] = {}
    for key, s in specs.items():
        dtype = dtype_from_name(s["dtype"])
        off, n = int(s["offset"]), int(s["nbytes"])
        if n == 0:
            out[key] = torch.empty(s["shape"], dtype=dtype)
            continue
        raw = torch.from_numpy(arr[off:off + n])
        out[key] = (raw.clone() if copy else raw).view(dtype).reshape(s["shape"])  # clone as bytes: any dtype
    del arr
    return out


def release(handle: Mapping[str, Any]) -> bool:
    """Producer side: remove a segment that no consumer took. True if it was still there."""
    name = handle.get("segment")
    if name is None:
        return False
    if not isinstance(name, str) or not _SAFE_NAME.match(name):
        raise ShmError(f"malformed shm handle: bad segment name {name!r}")
    return _unlink_quiet(name)


def _unlink_quiet(name: str) -> bool:
    try:
        os.unlink(_path(name))
        return True
    except FileNotFoundError:
        return False


def list_segments(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Names of existing segments with this prefix."""
    _check_prefix(prefix)
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def cleanup_segments(prefix: str, *, only_dead_producers: bool = False) -> list[str]:
    """Remove leftover segments named ``prefix...`` (crash cleanup); returns the removed names.

    ``only_dead_producers=True`` keeps segments whose producing process is still alive.
    """
    removed = []
    for name in list_segments(prefix):
        if only_dead_producers:
            pid_text = name[len(prefix):].split("_", 1)[0]
            if pid_text.isdigit() and pid_alive(int(pid_text)):
                continue
        if _unlink_quiet(name):
            removed.append(name)
    if removed:
        logger.info("removed %d leftover shared-memory segment(s) with prefix %r", len(removed), prefix)
    return removed


class ShmPool:
    """Pre-faulted segments ready for ``put_tensors`` (refilled in a background thread).

    Why: writing into fresh tmpfs pages costs ~3x a plain memcpy (page faults + zeroing).
    A pool segment is allocated and mapped with MAP_POPULATE ahead of time, so the
    transfer itself is one memcpy. Each taken segment is replaced by one sized for the
    last request (+12.5%, rounded to 2 MiB), within ``max_bytes`` / ``max_segments``.
    Requests below ``min_bytes`` skip the pool (fresh small segments are cheap).
    Warm segments are unlinked by ``close()`` and at interpreter exit.
    """

    _live: "weakref.WeakSet[ShmPool]" = weakref.WeakSet()

    def __init__(self, prefix: str = DEFAULT_PREFIX, *, max_bytes: int = 1 << 30, max_segments: int = 8,
                 min_bytes: int = _MiB, background: bool = True) -> None:
        self.prefix = _check_prefix(prefix)
        self.max_bytes = int(max_bytes)
        self.max_segments = int(max_segments)
        self.min_bytes = int(min_bytes)
        self._warm: list[_Segment] = []
        self._lock = threading.Lock()
        self._closed = False
        self.hits = 0
        self.misses = 0
        self._queue: queue.Queue[int | None] | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._refill_loop, name="shm-pool", daemon=True)
            self._thread.start()
        ShmPool._live.add(self)

    @property
    def warm_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._warm)

    def reserve(self, nbytes: int, count: int = 1) -> None:
        """Create ``count`` warm segments of ``nbytes`` now (blocking): do it before timing-critical work."""
        for _ in range(count):
            self._add(_create_segment(self.prefix, self._round(nbytes), populate=True))

    def acquire(self, nbytes: int) -> _Segment | None:
        """A warm segment of >= nbytes (and not wastefully larger), or None."""
        if nbytes < self.min_bytes or self._closed:
            return None
        with self._lock:
            fits = [s for s in self._warm if nbytes <= s.size <= max(2 * nbytes, nbytes + 8 * _MiB)]
            seg = min(fits, key=lambda s: s.size) if fits else None
            if seg is not None:
                self._warm.remove(seg)
                self.hits += 1
            else:
                self.misses += 1
        return seg

    def refill(self, nbytes: int) -> None:
        """Queue the creation of a warm segment for a request of ``nbytes`` (after the copy, so that
        zeroing new pages does not compete with it for memory bandwidth)."""
        if self._queue is not None and nbytes >= self.min_bytes and not self._closed:
            self._queue.put(self._round(nbytes + nbytes // 8))

    def put_tensors(self, tensors: Mapping[str, torch.Tensor]) -> dict:
        return put_tensors(tensors, pool=self)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until queued refills are done (e.g. between benchmark rounds). False on timeout."""
        if self._queue is None:
            return True
        q = self._queue
        with q.all_tasks_done:
            return q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0, timeout)

    def close(self) -> None:
        """Stop refilling and unlink every warm segment."""
        if self._closed:
            return
        self._closed = True
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join(5.0)
        with self._lock:
            warm, self._warm = self._warm, []
        for s in warm:
            _unlink_quiet(s.name)
            s.mm.close()

    def __enter__(self) -> "ShmPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @staticmethod
    def _round(n: int) -> int:
        return max(2 * _MiB, -(-n // (2 * _MiB)) * 2 * _MiB)

    def _add(self, seg: _Segment) -> None:
        evicted = []
        with self._lock:
            if self._closed or seg.size > self.max_bytes:
                evicted.append(seg)
            else:
                self._warm.append(seg)
                while (len(self._warm) > self.max_segments
                       or sum(s.size for s in self._warm) > self.max_bytes):
                    evicted.append(self._warm.pop(0))  # oldest first
        for s in evicted:
            _unlink_quiet(s.name)
            s.mm.close()

    def _refill_loop(self) -> None:
        assert self._queue is not None
        while True:
            size = self._queue.get()
            try:
                if size is None:
                    return
                if not self._closed and size <= self.max_bytes:
                    self._add(_create_segment(self.prefix, size, populate=True))
            except Exception as e:  # noqa: BLE001 - a failed refill only costs speed
                logger.warning("shm pool refill of %d bytes failed: %s", size, e)
            finally:
                self._queue.task_done()


@atexit.register
def _close_pools() -> None:
    for pool in list(ShmPool._live):
        pool.close()
