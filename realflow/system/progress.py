"""Progress records from the master, rendered by the launcher.

The master runs in its own process with its output going to a log file, so it can't
draw a terminal progress bar. It appends small JSON records to
``<run_dir>/progress.jsonl``; the launcher tails that file and draws the bar and
the events (evaluation results, checkpoint paths) on the user's console.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Optional


class ProgressReporter:
    """Writer side (master)."""

    def __init__(self, run_dir: str):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "progress.jsonl")
        self._f = open(self.path, "a", buffering=1)

    def _write(self, kind: str, **fields: Any) -> None:
        self._f.write(json.dumps({"kind": kind, "time": time.time(), **fields}, default=float) + "\n")

    def start(self, total: int) -> None:
        self._write("start", total=total)

    def update(self, step: int, stats: dict[str, float]) -> None:
        self._write("step", step=step, stats=stats)

    def event(self, message: str) -> None:
        self._write("event", message=message)

    def error(self, message: str, fault: bool = False) -> None:
        """The run failed; ``message`` is one line naming the culprit. ``fault``: a lost or
        unresponsive process (a relaunch may fix it), not an error of the experiment's code."""
        self._write("error", message=message, fault=bool(fault))

    def finish(self, summary: dict[str, Any]) -> None:
        self._write("finish", summary=summary)
        self._f.close()


class ProgressFollower:
    """Reader side (launcher): feed new records to callbacks, incrementally."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, "progress.jsonl")
        self._offset = 0
        self._partial = ""
        self.summary: Optional[dict[str, Any]] = None
        self.error: Optional[str] = None
        self.error_is_fault = False

    def poll(self, on_record: Callable[[dict[str, Any]], None]) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            f.seek(self._offset)
            chunk = f.read()
            self._offset = f.tell()
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()
        for line in lines:
            if line.strip():
                rec = json.loads(line)
                if rec["kind"] == "finish":
                    self.summary = rec["summary"]
                elif rec["kind"] == "error":
                    self.error = rec["message"]
                    self.error_is_fault = bool(rec.get("fault"))
                on_record(rec)
