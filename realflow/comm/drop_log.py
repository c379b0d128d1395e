"""Log what a socket or an HTTP service drops as unauthenticated, without letting a flood fill the log.

Why: a forged, tampered or replayed message (or an HTTP request without the run's
token) is dropped before it is decoded, and someone operating the run should see
that it happened and who it claimed to be -- but an attacker (or a stale process of
another run) sending thousands must not turn the log into noise.  Every endpoint
that checks authentication keeps one :class:`DropLog`: the first
:data:`LOG_FIRST` drops per claimed sender are logged, then one every
:data:`LOG_EVERY`; all are counted.
"""
from __future__ import annotations

import logging
from typing import Optional

__all__ = ["DropLog", "LOG_FIRST", "LOG_EVERY"]

logger = logging.getLogger("realflow.comm.drops")

LOG_FIRST = 10
LOG_EVERY = 1000
_MAX_SENDERS = 10_000  # per-sender counts kept (a flood of made-up names must not grow memory)


class DropLog:
    """``drop(claimed_sender, reason)``: count one dropped message and maybe log it."""

    def __init__(self, who: str, what: str = "message") -> None:
        self.who, self.what = who, what
        self.count = 0
        self.logged = 0
        self._per_sender: dict[str, int] = {}

    def __call__(self, claimed: Optional[str], reason: str) -> None:
        self.count += 1
        key = claimed or "?"
        n = self._per_sender.get(key, 0) + 1
        if key in self._per_sender or len(self._per_sender) < _MAX_SENDERS:
            self._per_sender[key] = n
        if n <= LOG_FIRST or n % LOG_EVERY == 0:
            self.logged += 1
            logger.warning("%s dropped a %s claiming to be from %r: %s (%d dropped from it so far)",
                           self.who, self.what, claimed, reason, n)
