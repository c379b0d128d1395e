"""Name resolution: how realflow processes find each other.

Workers publish their addresses under well-known keys (see ``realflow.base.names``)
and others look them up or wait for them. Three backends share one interface:

* ``FileNameResolver`` (default) - a directory of small files; one host, or several
  hosts over a shared file system. No daemon to run.
* ``EtcdNameResolver`` - an etcd v3 cluster, for multi-node jobs without a shared
  file system.
* ``RedisNameResolver`` - a Redis server, for the same jobs where a Redis is at hand.

Liveness: a key added with a ``ttl`` is kept alive by a background refresher in the
process that added it. When that process dies, nobody refreshes the key and it
disappears after its TTL, so "is worker X still registered?" doubles as "is it
alive?". Stopping the refresher (``stop_keep_alive`` / ``close``) has the same
effect on purpose, so that a clean shutdown looks the same as a crash to readers.

Keys are '/'-separated paths of simple components (letters, digits and ``_-.:=+@,``),
e.g. ``realflow/my_exp/trial0/workers/model/3``. Values are strings. Never store
secrets here: anyone who can read the directory or the etcd/Redis server reads them.
"""
from __future__ import annotations

import abc
import dataclasses
import os
import re
import threading
from typing import Any, Mapping

from realflow.base.logging import get_logger
from realflow.base.timeutil import Deadline, format_seconds

logger = get_logger("realflow.name_resolve")

_COMPONENT_RE = re.compile(r"^[A-Za-z0-9_\-.:=+@,]+$")
_SECRET_WORDS = ("secret", "password", "passwd")


class NameResolveError(RuntimeError):
    """Base class of all name-resolution errors."""


class NameNotFound(NameResolveError, KeyError):
    """The key does not exist (or its TTL expired)."""

    def __init__(self, key: str, where: str = "") -> None:
        msg = f"name '{key}' not found" + (f" in {where}" if where else "")
        super().__init__(msg)
        self.key = key

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0])


class NameExists(NameResolveError):
    """``add`` of an existing key without ``replace=True``."""

    def __init__(self, key: str, where: str = "") -> None:
        super().__init__(
            f"name '{key}' already exists" + (f" in {where}" if where else "")
            + "; pass replace=True to overwrite it"
        )
        self.key = key


class NameWaitTimeout(NameResolveError, TimeoutError):
    """``wait`` / ``wait_subtree`` ran out of time; the message names what was missing."""


def normalize_key(key: str, what: str = "key") -> str:
    """Validate a key (or prefix) and return it without leading/trailing '/'.

    Rejecting odd characters here keeps the file backend's paths safe (no '..',
    no hidden files) and makes both backends agree on what a subtree is.
    """
    if not isinstance(key, str):
        raise NameResolveError(f"{what} must be a str, got {type(key).__name__}: {key!r}")
    norm = key.strip("/")
    if not norm:
        raise NameResolveError(f"{what} must not be empty (got {key!r})")
    for comp in norm.split("/"):
        if not comp:
            raise NameResolveError(f"{what} {key!r} has an empty component ('//')")
        if comp.startswith("."):
            raise NameResolveError(f"{what} {key!r}: component {comp!r} must not start with '.'")
        if not _COMPONENT_RE.match(comp):
            raise NameResolveError(
                f"{what} {key!r}: component {comp!r} may only contain letters, digits and '_-.:=+@,'"
            )
        low = comp.lower()
        if any(w in low for w in _SECRET_WORDS):
            raise NameResolveError(
                f"{what} {key!r} looks like a secret; name resolution is readable by every process "
                "with access to it, so pass secrets through a 0600 file or the environment instead"
            )
    return norm


def in_subtree(key: str, prefix: str) -> bool:
    """Component-wise prefix test: 'a/b' is in subtree 'a' but 'ab' is not."""
    return key == prefix or key.startswith(prefix + "/")


@dataclasses.dataclass
class _Owned:
    handle: Any  # backend-specific: file owner token, etcd lease id, redis record
    ttl: float


class NameResolver(abc.ABC):
    """Interface of a name-resolution backend (see module docstring).

    Subclasses implement the underscore methods; this class does validation, the
    keep-alive thread, and the generic polling ``wait`` / ``wait_subtree``.
    """

    def __init__(self) -> None:
        self._owned: dict[str, _Owned] = {}
        self._owned_lock = threading.Lock()
        self._ka_stop = threading.Event()
        self._ka_wake = threading.Event()
        self._ka_thread: threading.Thread | None = None
        self._closed = False

    # ---- backend hooks ------------------------------------------------------------
    @abc.abstractmethod
    def describe(self) -> str:
        """Where the names live, for error messages ('files under /x', 'etcd at h:p')."""

    @abc.abstractmethod
    def _add(self, key: str, value: str, ttl: float | None, replace: bool) -> Any:
        """Store the key; return a handle used by ``_refresh`` (ignored without ttl)."""

    @abc.abstractmethod
    def _get(self, key: str) -> str | None:
        """Value of a live key, or None."""

    @abc.abstractmethod
    def _get_subtree(self, prefix: str) -> dict[str, str]:
        """All live keys ``in_subtree(key, prefix)`` with their values."""

    @abc.abstractmethod
    def _delete(self, key: str) -> bool:
        """Remove one key; False if it did not exist."""

    @abc.abstractmethod
    def _clear_subtree(self, prefix: str) -> int:
        """Remove the subtree; return how many live keys were removed."""

    @abc.abstractmethod
    def _refresh(self, key: str, handle: Any, ttl: float) -> bool:
        """Extend a TTL key; False if the key is no longer ours (deleted, replaced, expired)."""

    def _release(self, handle: Any) -> None:
        """Forget a handle we no longer refresh (e.g. revoke an unused etcd lease)."""

    # ---- public API ---------------------------------------------------------------
    def add(
        self,
        key: str,
        value: str,
        ttl: float | None = None,
        replace: bool = False,
        keep_alive: bool = True,
    ) -> None:
        """Publish ``key -> value``.

        Raises ``NameExists`` if the key is live and ``replace`` is False. With ``ttl``
        (seconds) the key expires unless refreshed; with ``keep_alive`` (default) this
        resolver refreshes it in the background until ``stop_keep_alive``/``close``/
        ``delete`` or until this process dies.
        """
        key = normalize_key(key)
        self._check_open()
        if not isinstance(value, str):
            raise NameResolveError(f"value of '{key}' must be a str, got {type(value).__name__}")
        if ttl is not None and not ttl > 0:
            raise NameResolveError(f"ttl of '{key}' must be > 0 seconds or None, got {ttl!r}")
        handle = self._add(key, value, ttl, replace)
        with self._owned_lock:
            old = self._owned.pop(key, None)
            if ttl is not None and keep_alive:
                self._owned[key] = _Owned(handle, float(ttl))
        if old is not None:
            self._release(old.handle)
        if ttl is not None and keep_alive:
            self._ensure_keep_alive()

    def get(self, key: str) -> str:
        """Value of ``key``; ``NameNotFound`` (a KeyError) naming the key if absent."""
        key = normalize_key(key)
        value = self._get(key)
        if value is None:
            raise NameNotFound(key, self.describe())
        return value

    def get_subtree(self, prefix: str) -> dict[str, str]:
        """``{key: value}`` of every live key equal to ``prefix`` or below it."""
        return dict(sorted(self._get_subtree(normalize_key(prefix, "prefix")).items()))

    def find_subtree(self, prefix: str) -> list[str]:
        """Sorted keys of ``get_subtree(prefix)``."""
        return sorted(self._get_subtree(normalize_key(prefix, "prefix")))

    def delete(self, key: str) -> None:
        """Remove ``key`` (and stop refreshing it); ``NameNotFound`` if absent."""
        key = normalize_key(key)
        with self._owned_lock:
            old = self._owned.pop(key, None)
        deleted = self._delete(key)
        if old is not None:  # after the delete: releasing an etcd lease deletes its keys too
            self._release(old.handle)
        if not deleted:
            raise NameNotFound(key, self.describe())

    def clear_subtree(self, prefix: str) -> int:
        """Remove every key in the subtree; returns how many live keys were removed."""
        prefix = normalize_key(prefix, "prefix")
        with self._owned_lock:
            mine = [k for k in self._owned if in_subtree(k, prefix)]
            released = [self._owned.pop(k).handle for k in mine]
        n = self._clear_subtree(prefix)
        for handle in released:
            self._release(handle)
        return n

    def wait(self, key: str, timeout: float, poll_interval: float = 0.2) -> str:
        """Block until ``key`` exists and return its value.

        Raises ``NameWaitTimeout`` naming the key and how long it waited.
        """
        key = normalize_key(key)
        deadline = Deadline(timeout)
        delay = 0.01
        while True:
            value = self._get(key)
            if value is not None:
                return value
            if deadline.expired():
                raise NameWaitTimeout(
                    f"timed out after {format_seconds(deadline.elapsed())} waiting for name "
                    f"'{key}' in {self.describe()}"
                )
            deadline.sleep(delay)
            delay = min(delay * 2, poll_interval)

    def wait_subtree(
        self, prefix: str, count: int, timeout: float, poll_interval: float = 0.2
    ) -> dict[str, str]:
        """Block until at least ``count`` keys exist under ``prefix``; return them.

        Typical use: the master waits for all N workers to register. The timeout
        message lists the keys that did arrive, so the missing ones are obvious.
        """
        prefix = normalize_key(prefix, "prefix")
        deadline = Deadline(timeout)
        delay = 0.01
        while True:
            found = self._get_subtree(prefix)
            if len(found) >= count:
                return dict(sorted(found.items()))
            if deadline.expired():
                shown = ", ".join(sorted(found)[:20]) or "none"
                raise NameWaitTimeout(
                    f"timed out after {format_seconds(deadline.elapsed())} waiting for {count} "
                    f"names under '{prefix}' in {self.describe()}; found {len(found)}: {shown}"
                )
            deadline.sleep(delay)
            delay = min(delay * 2, poll_interval)

    def stop_keep_alive(self, key: str | None = None) -> None:
        """Stop refreshing ``key`` (or every key of this resolver); it then expires by TTL."""
        with self._owned_lock:
            if key is None:
                keys = list(self._owned)
            else:
                norm = normalize_key(key)
                keys = [norm] if norm in self._owned else []
            handles = [self._owned.pop(k).handle for k in keys]
        # Deliberately no _release here: revoking an etcd lease would delete the key at
        # once, but stopping the refresher must look like a crash (expiry after TTL).
        del handles

    def owned_keys(self) -> list[str]:
        """Keys this resolver currently keeps alive."""
        with self._owned_lock:
            return sorted(self._owned)

    def close(self) -> None:
        """Stop the keep-alive thread (owned TTL keys then expire). Idempotent."""
        if self._closed:
            return
        self.stop_keep_alive()
        self._ka_stop.set()
        self._ka_wake.set()
        if self._ka_thread is not None and self._ka_thread is not threading.current_thread():
            self._ka_thread.join(timeout=5)
        self._closed = True

    def __enter__(self) -> "NameResolver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- keep-alive ---------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise NameResolveError(f"name resolver ({self.describe()}) is closed")

    def _ensure_keep_alive(self) -> None:
        self._ka_wake.set()  # re-evaluate the interval if a shorter TTL arrived
        if self._ka_thread is None:
            self._ka_thread = threading.Thread(
                target=self._keep_alive_loop, name="name-resolve-keepalive", daemon=True
            )
            self._ka_thread.start()

    def _keep_alive_loop(self) -> None:
        # Refresh every ttl/3 so that one late or failed refresh does not expire a key.
        while not self._ka_stop.is_set():
            with self._owned_lock:
                items = list(self._owned.items())
            interval = min((o.ttl for _, o in items), default=60.0) / 3.0
            for key, owned in items:
                if self._ka_stop.is_set():
                    return
                try:
                    ok = self._refresh(key, owned.handle, owned.ttl)
                except Exception as e:  # backend unreachable: keep trying; the key may lapse
                    logger.warning("keep-alive of '%s' failed: %s", key, e)
                    continue
                if not ok:
                    with self._owned_lock:
                        if self._owned.get(key) is owned:
                            del self._owned[key]
                    logger.warning(
                        "stopped keeping '%s' alive: it was deleted, replaced or expired in %s",
                        key, self.describe(),
                    )
            self._ka_wake.wait(timeout=max(0.05, interval))
            self._ka_wake.clear()


@dataclasses.dataclass
class NameResolveConfig:
    """Which name-resolution backend to use.

    type: 'file' (a directory; default), 'etcd' or 'redis'.
    root: directory of the file backend; empty means $REALFLOW_NAME_RESOLVE_ROOT or
          /tmp/realflow-<user>/name_resolve.
    host, port: etcd or redis server (those backends only); port 0 means the
          backend's usual port (etcd 2379, redis 6379).
    """

    type: str = "file"
    root: str = ""
    host: str = "127.0.0.1"
    port: int = 0


def default_file_root() -> str:
    env = os.environ.get("REALFLOW_NAME_RESOLVE_ROOT")
    if env:
        return env
    user = os.environ.get("USER") or str(os.getuid())
    return os.path.join("/tmp", f"realflow-{user}", "name_resolve")


def make_name_resolver(config: NameResolveConfig | Mapping[str, Any] | None = None) -> NameResolver:
    """Build the backend named by ``config.type`` (a NameResolveConfig or an equivalent dict)."""
    if config is None:
        config = NameResolveConfig()
    elif isinstance(config, Mapping):
        fields = {f.name for f in dataclasses.fields(NameResolveConfig)}
        unknown = sorted(set(config) - fields)
        if unknown:
            raise NameResolveError(
                f"name_resolve: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}"
            )
        config = NameResolveConfig(**config)
    if config.type == "file":
        from realflow.base.name_resolve_file import FileNameResolver

        return FileNameResolver(config.root or default_file_root())
    if config.type == "etcd":
        from realflow.base.name_resolve_etcd import EtcdNameResolver

        return EtcdNameResolver(config.host, _port(config, 2379))
    if config.type == "redis":
        from realflow.base.name_resolve_redis import RedisNameResolver

        return RedisNameResolver(config.host, _port(config, 6379))
    raise NameResolveError(
        f"name_resolve.type={config.type!r} is not a known backend; choose 'file', 'etcd' or 'redis'"
    )


def _port(config: NameResolveConfig, default: int) -> int:
    port = int(config.port) or default
    if not 0 < port < 65536:
        raise NameResolveError(f"name_resolve.port={config.port!r} is not a TCP port (0 = {default})")
    return port


def __getattr__(name: str) -> Any:
    # Backends live in their own modules; import lazily so that 'file' users never
    # import requests or redis, and so that the backends can import this module freely.
    if name == "FileNameResolver":
        from realflow.base.name_resolve_file import FileNameResolver

        return FileNameResolver
    if name == "EtcdNameResolver":
        from realflow.base.name_resolve_etcd import EtcdNameResolver

        return EtcdNameResolver
    if name == "RedisNameResolver":
        from realflow.base.name_resolve_redis import RedisNameResolver

        return RedisNameResolver
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "NameResolver", "NameResolveError", "NameNotFound", "NameExists", "NameWaitTimeout",
    "NameResolveConfig", "make_name_resolver", "normalize_key", "in_subtree",
    "FileNameResolver", "EtcdNameResolver", "RedisNameResolver", "default_file_root",
]
