"""Merged console view of many workers' log files.

Workers write only to their own log file (so nothing is lost when the console is
slow or closed); one thread tails all files and prints each complete line with
the worker's name in front. Tailing files rather than pipes also means a worker
can never block on a full pipe because the launcher is busy.
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import TextIO


class ConsoleTail:
    """Tails log files and prints ``[name] line`` to ``stream`` (default sys.stdout)."""

    def __init__(self, stream: TextIO | None = None, interval: float = 0.1) -> None:
        self._stream = stream
        self._interval = interval
        self._files: dict[str, tuple[Path, int, bytes]] = {}  # name -> (path, offset, partial line)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._width = 0

    def add(self, name: str, path: str | Path) -> None:
        with self._lock:
            self._files[name] = (Path(path), 0, b"")
            self._width = max(self._width, len(name))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="console-tail", daemon=True)
            self._thread.start()

    def _emit(self, name: str, lines: list[bytes]) -> None:
        if not lines:
            return
        out = self._stream or sys.stdout
        prefix = f"[{name:<{self._width}}] "
        text = "".join(prefix + ln.decode("utf-8", "replace").rstrip("\r") + "\n" for ln in lines)
        try:
            out.write(text)
            out.flush()
        except (ValueError, OSError):  # console closed: the log files still have everything
            pass

    def poll(self, final: bool = False) -> None:
        """Print what was appended since the last poll (and partial lines if ``final``)."""
        with self._lock:
            for name, (path, offset, partial) in list(self._files.items()):
                try:
                    with open(path, "rb") as f:
                        f.seek(offset)
                        data = f.read()
                except FileNotFoundError:
                    continue
                buf = partial + data
                lines = buf.split(b"\n")
                rest = lines.pop()
                if final and rest:
                    lines.append(rest)
                    rest = b""
                self._files[name] = (path, offset + len(data), rest)
                self._emit(name, lines)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.poll()

    def stop(self) -> None:
        """Stop the thread and print everything that is left."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.poll(final=True)
