"""File-directory name resolution backend (the default).

Layout: key ``a/b/c`` is the JSON file ``<root>/a/b/c/.value`` holding
``{"value": ..., "expires": <unix time or null>, "owner": <token>}``. Keeping the
value in a file *inside* the key's directory lets a key and its children coexist
(``a/b`` and ``a/b/c``), exactly as in etcd.

Concurrency:
* Readers take no lock. Writers write a temporary file in the same directory and
  ``os.replace`` it into place, so a reader sees the old or the new record, never
  a torn one.
* Writers (add, delete, refresh, clear) serialize on ``flock`` of ``<root>/.lock``.
  That makes "add unless it exists" atomic across processes, and it works on a
  shared file system that supports locks (NFSv4, Lustre with flock). Name
  operations are rare (startup, heartbeats every few seconds), so one lock is
  cheap and far simpler than per-key locks.

TTL: a record with ``expires`` in the past is treated as absent by every reader.
The owner's keep-alive rewrites ``expires`` every ttl/3 while the record still
carries its owner token; a record that expired, was deleted, or was replaced by
someone else is never brought back. Expiry uses wall-clock time, so hosts sharing
the directory need roughly synchronized clocks (NTP), as is normal on clusters.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Iterator

from realflow.base.name_resolve import NameExists, NameResolveError, NameResolver

VALUE_FILE = ".value"
LOCK_FILE = ".lock"


class FileNameResolver(NameResolver):
    """Name resolution in a directory (see module docstring)."""

    def __init__(self, root_dir: str | os.PathLike) -> None:
        super().__init__()
        self.root = Path(root_dir).absolute()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise NameResolveError(f"cannot create name-resolve directory {self.root}: {e}") from None
        self._lock_path = self.root / LOCK_FILE
        # One token per resolver: refresh only records that this resolver wrote.
        self._token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"

    def describe(self) -> str:
        return f"files under {self.root}"

    # ---- helpers ------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    def _dir(self, key: str) -> Path:
        return self.root.joinpath(*key.split("/"))

    def _read(self, path: Path) -> dict | None:
        """Raw record (expired or not), or None if there is no file."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            rec = json.loads(data)
            if not isinstance(rec, dict) or not isinstance(rec.get("value"), str):
                raise ValueError("not a name record")
        except ValueError as e:
            raise NameResolveError(f"corrupt name record {path}: {e}") from None
        return rec

    @staticmethod
    def _live(rec: dict | None, now: float) -> bool:
        return rec is not None and (rec.get("expires") is None or rec["expires"] > now)

    def _write(self, key: str, rec: dict) -> None:
        d = self._dir(key)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".tmp.{os.getpid()}.{uuid.uuid4().hex}"
        try:
            with open(tmp, "w") as f:
                json.dump(rec, f)
            os.replace(tmp, d / VALUE_FILE)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _prune_empty_dirs(self, d: Path) -> None:
        # Called under the lock: no writer can be creating a file in these dirs.
        while d != self.root and self.root in d.parents:
            try:
                d.rmdir()
            except OSError:
                return
            d = d.parent

    # ---- backend hooks ------------------------------------------------------------
    def _add(self, key: str, value: str, ttl: float | None, replace: bool) -> str:
        with self._locked():
            path = self._dir(key) / VALUE_FILE
            if not replace and self._live(self._read(path), time.time()):
                raise NameExists(key, self.describe())
            expires = None if ttl is None else time.time() + ttl
            self._write(key, {"value": value, "expires": expires, "owner": self._token, "ttl": ttl})
        return self._token

    def _get(self, key: str) -> str | None:
        rec = self._read(self._dir(key) / VALUE_FILE)
        return rec["value"] if self._live(rec, time.time()) else None

    def _get_subtree(self, prefix: str) -> dict[str, str]:
        base = self._dir(prefix)
        now = time.time()
        out: dict[str, str] = {}
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [n for n in dirnames if not n.startswith(".")]
            if VALUE_FILE in filenames:
                path = Path(dirpath)
                rec = self._read(path / VALUE_FILE)
                if self._live(rec, now):
                    out["/".join(path.relative_to(self.root).parts)] = rec["value"]
        return out

    def _delete(self, key: str) -> bool:
        with self._locked():
            d = self._dir(key)
            rec = self._read(d / VALUE_FILE)
            if rec is None:
                return False
            os.unlink(d / VALUE_FILE)
            self._prune_empty_dirs(d)
            return self._live(rec, time.time())

    def _clear_subtree(self, prefix: str) -> int:
        with self._locked():
            n = len(self._get_subtree(prefix))
            d = self._dir(prefix)
            shutil.rmtree(d, ignore_errors=True)
            self._prune_empty_dirs(d.parent)
            return n

    def _refresh(self, key: str, handle: str, ttl: float) -> bool:
        with self._locked():
            rec = self._read(self._dir(key) / VALUE_FILE)
            now = time.time()
            if rec is None or rec.get("owner") != handle or not self._live(rec, now):
                return False
            rec["expires"] = now + ttl
            self._write(key, rec)
            return True
