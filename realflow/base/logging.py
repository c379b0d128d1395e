"""Logging with one format for every realflow process.

Many processes write into one merged console (see ``realflow.scheduler.local``), so
every line says which process role wrote it: the role comes from
``set_process_role`` or, by default, from $REALFLOW_ROLE, which the launcher sets
to the worker's name. Level: $REALFLOW_LOG_LEVEL (default INFO).

Example line::

    20250101-12:00:00.123 I trainer0:4242 realflow.system.master | step 3 done
"""
from __future__ import annotations

import logging
import os
import sys
import threading

LOG_FORMAT = "%(asctime)s.%(msecs)03d %(levelname).1s %(role)s:%(process)d %(name)s | %(message)s"
DATE_FORMAT = "%Y%m%d-%H:%M:%S"

_role = os.environ.get("REALFLOW_ROLE") or "main"
_lock = threading.Lock()
_handler: logging.Handler | None = None


def set_process_role(role: str) -> None:
    """Name this process in every later log line (e.g. 'master', 'model_worker3')."""
    global _role
    _role = str(role)


def get_process_role() -> str:
    return _role


class _RoleFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.role = _role
        return True


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (pytest swaps it)."""

    @property  # type: ignore[override]
    def stream(self):  # noqa: D401
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _shared_handler() -> logging.Handler:
    global _handler
    with _lock:
        if _handler is None:
            h = _StderrHandler()
            h.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
            h.addFilter(_RoleFilter())
            _handler = h
        return _handler


def get_logger(name: str, level: int | str | None = None) -> logging.Logger:
    """A logger that prints in the realflow format, with the process role.

    Loggers do not propagate to the root logger so that libraries which configure
    the root (transformers, megatron) do not print our lines twice.
    """
    logger = logging.getLogger(name)
    handler = _shared_handler()
    if handler not in logger.handlers:
        logger.addHandler(handler)
        logger.propagate = False
        if logger.level == logging.NOTSET:
            logger.setLevel(os.environ.get("REALFLOW_LOG_LEVEL", "INFO").upper())
    if level is not None:
        logger.setLevel(level.upper() if isinstance(level, str) else level)
    return logger
