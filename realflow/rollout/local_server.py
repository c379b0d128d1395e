"""Start one builtin-engine generation server as a child process and wait for its URL.

For tests and benchmarks on one host (the launcher starts the servers of a real run):
the server binds a free loopback port and prints ``READY <url>``; a server that exits or
stays silent past the timeout is killed and reported with the tail of its log.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Optional

__all__ = ["start_local_gen_server"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_local_gen_server(model_path: str, *extra: str, log_path: Optional[str] = None,
                           env: Optional[dict] = None, timeout_s: float = 120.0) -> tuple[str, subprocess.Popen]:
    """``(url, process)`` of a running server (one torch thread); ``extra``: more CLI flags."""
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    full_env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "realflow.rollout.gen_server", "--model", model_path, "--backend", "builtin",
         "--port", "0", "--threads", "1", *extra],
        stdout=subprocess.PIPE, stderr=log, text=True, env=full_env, cwd=ROOT)
    ready: list[str] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("READY "):
                ready.append(line.split()[1])

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            tail = open(log_path).read()[-3000:] if log_path else "(no log kept)"
            raise RuntimeError(f"gen server for {model_path} did not start within {timeout_s:.0f}s:\n{tail}")
        time.sleep(0.1)
    return ready[0], proc
