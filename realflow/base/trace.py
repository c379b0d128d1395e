"""Timeline tracing in the Chrome / Perfetto trace-event JSON format.

Each process records spans (``with tracer.span("train_step", mfc="actor_train"):``)
into memory and saves ``{"traceEvents": [...]}`` to its own file; ``merge_traces``
joins the files of all processes into one timeline that chrome://tracing or
https://ui.perfetto.dev opens directly.

Timestamps are wall-clock microseconds (anchored once, then advanced with the
monotonic clock), so spans from different processes line up in the merged view.

A disabled tracer costs one attribute check per span: ``span`` returns a shared
no-op context manager, so tracing calls can stay in hot paths.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence


class _NullSpan:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL_SPAN = _NullSpan()


def _jsonable(v: Any) -> Any:
    return v if isinstance(v, (str, int, float, bool, type(None))) else str(v)


class _Span:
    __slots__ = ("_tracer", "_name", "_args", "_t0")

    def __init__(self, tracer: "Tracer", name: str, args: dict[str, Any]) -> None:
        self._tracer, self._name, self._args = tracer, name, args

    def __enter__(self) -> "_Span":
        self._t0 = self._tracer.now_us()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        t1 = self._tracer.now_us()
        args = {k: _jsonable(v) for k, v in self._args.items()}
        if exc_type is not None:
            args["error"] = exc_type.__name__
        self._tracer._record({"name": self._name, "ph": "X", "ts": self._t0, "dur": t1 - self._t0,
                              "args": args})


class Tracer:
    """Records spans of one process; ``save`` writes them as trace-event JSON.

    ``path``: where ``save()`` writes by default. ``max_events`` bounds memory in
    long runs: later events are dropped (and counted in the saved metadata).
    """

    def __init__(self, process_name: str, path: str | os.PathLike | None = None,
                 enabled: bool = True, max_events: int = 1_000_000) -> None:
        self.process_name = process_name
        self.path = Path(path) if path is not None else None
        self.enabled = enabled
        self.max_events = max_events
        self.pid = os.getpid()
        self._events: list[dict[str, Any]] = []
        self._threads: set[int] = set()
        self._dropped = 0
        self._lock = threading.Lock()
        self._wall0_us = time.time_ns() // 1000
        self._mono0_ns = time.perf_counter_ns()

    def now_us(self) -> float:
        """Current trace timestamp (microseconds since the epoch)."""
        return self._wall0_us + (time.perf_counter_ns() - self._mono0_ns) / 1000.0

    def span(self, name: str, **args: Any):
        """Context manager recording one complete ('X') event around its body."""
        if not self.enabled:
            return _NULL_SPAN
        return _Span(self, name, args)

    def instant(self, name: str, **args: Any) -> None:
        """A point in time (e.g. 'weights updated to version 7')."""
        if self.enabled:
            self._record({"name": name, "ph": "i", "s": "p", "ts": self.now_us(),
                          "args": {k: _jsonable(v) for k, v in args.items()}})

    def counter(self, name: str, **values: float) -> None:
        """A counter track (e.g. buffer size, tokens in flight)."""
        if self.enabled:
            self._record({"name": name, "ph": "C", "ts": self.now_us(),
                          "args": {k: float(v) for k, v in values.items()}})

    def _record(self, ev: dict[str, Any]) -> None:
        tid = threading.get_native_id()
        ev["pid"], ev["tid"] = self.pid, tid
        with self._lock:
            if len(self._events) >= self.max_events:
                self._dropped += 1
                return
            if tid not in self._threads:
                self._threads.add(tid)
                self._events.append({"name": "thread_name", "ph": "M", "pid": self.pid, "tid": tid,
                                     "args": {"name": threading.current_thread().name}})
            self._events.append(ev)

    @property
    def events(self) -> list[dict[str, Any]]:
        """Metadata plus recorded events, as they will be saved."""
        meta = [{"name": "process_name", "ph": "M", "pid": self.pid, "tid": 0,
                 "args": {"name": self.process_name}}]
        with self._lock:
            return meta + list(self._events)

    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write the trace (atomically) to ``path`` or the constructor's path."""
        target = Path(path) if path is not None else self.path
        if target is None:
            raise ValueError(f"Tracer({self.process_name!r}).save: no path given here or at construction")
        doc = {"traceEvents": self.events, "displayTimeUnit": "ms",
               "otherData": {"process_name": self.process_name, "dropped_events": self._dropped}}
        _atomic_write_json(target, doc)
        return target


def _atomic_write_json(path: Path, doc: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def load_trace(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Events of a trace file (object form with 'traceEvents', or a bare array)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path}: not a JSON trace: {e}") from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise ValueError(f"{path}: expected a list of events or an object with 'traceEvents'")
    return events


def merge_traces(files: Sequence[str | os.PathLike], out: str | os.PathLike) -> Path:
    """Join per-process trace files into one timeline at ``out``.

    Processes on different hosts can share a pid; each file whose pid was already
    taken by an earlier file gets a fresh one, so tracks never mix.
    """
    merged: list[dict[str, Any]] = []
    used: set[Any] = set()
    next_pid = 1 << 22  # above Linux's default pid_max, so no clash with real pids
    for f in files:
        events = load_trace(f)
        remap: dict[Any, Any] = {}
        for pid in dict.fromkeys(ev.get("pid") for ev in events):
            if pid in used:
                while next_pid in used:
                    next_pid += 1
                remap[pid] = next_pid
            used.add(remap.get(pid, pid))
        for ev in events:
            if ev.get("pid") in remap:
                ev = {**ev, "pid": remap[ev["pid"]]}
            merged.append(ev)
    merged.sort(key=lambda ev: (ev.get("ph") != "M", ev.get("ts", 0)))
    target = Path(out)
    _atomic_write_json(target, {"traceEvents": merged, "displayTimeUnit": "ms"})
    return target


def iter_spans(events: Sequence[dict[str, Any]], name: str | None = None) -> Iterator[dict[str, Any]]:
    """Complete events, optionally only those called ``name`` (tools and tests)."""
    for ev in events:
        if ev.get("ph") == "X" and (name is None or ev.get("name") == name):
            yield ev
