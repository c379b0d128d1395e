"""Small time helpers.

Every wait in realflow has a timeout, and a timeout message must say how long it
waited. ``Deadline`` keeps that bookkeeping in one place so that loops which poll
several things do not each re-implement "remaining time" arithmetic (and get it
subtly wrong with wall-clock jumps: it uses the monotonic clock).
"""
from __future__ import annotations

import time


class Deadline:
    """A point in the (monotonic) future; ``timeout=None`` means never."""

    __slots__ = ("timeout", "_start", "_end")

    def __init__(self, timeout: float | None) -> None:
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout!r}")
        self.timeout = timeout
        self._start = time.monotonic()
        self._end = None if timeout is None else self._start + timeout

    def remaining(self) -> float | None:
        """Seconds left (never negative), or None for an unbounded deadline."""
        if self._end is None:
            return None
        return max(0.0, self._end - time.monotonic())

    def expired(self) -> bool:
        return self._end is not None and time.monotonic() >= self._end

    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` but never past the deadline."""
        rem = self.remaining()
        time.sleep(seconds if rem is None else min(seconds, rem))


def format_seconds(seconds: float) -> str:
    """Human-readable duration for messages: '0.25s', '12.0s', '3m05s', '2h01m'."""
    if seconds < 10:
        return f"{seconds:.2f}s"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
