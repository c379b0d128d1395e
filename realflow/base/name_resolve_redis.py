"""Redis name resolution backend.

Why Redis beside etcd: many clusters already run a Redis, and a single
``redis-server`` with persistence off is the easiest shared store to start for a
multi-node job without a shared file system. Redis has native key expiry, which is
exactly the liveness rule of name resolution (see ``realflow.base.name_resolve``).

Layout: key ``a/b/c`` is the Redis string ``<namespace>a/b/c`` holding the JSON
record ``{"owner": <token>, "value": ...}``. The owner token is new for every
``add``, so the keep-alive can tell "my key" from "a key somebody replaced".

* ``add(replace=False)`` is one ``SET ... NX`` (atomic across all clients); a TTL
  is ``SET ... PX``. The base class's keep-alive re-arms it with ``PEXPIRE`` inside
  a small Lua script that first checks the record is still ours, so a deleted,
  replaced or expired key is never brought back. When the owning process dies,
  nobody re-arms the expiry and Redis drops the key after its TTL.
* Subtrees are ``GET`` of the prefix itself plus ``SCAN MATCH <prefix>/*`` (glob
  characters in the namespace/prefix escaped), then ``MGET``; every key found is
  re-checked with ``in_subtree``, so 'a' never sees 'ab' or 'a-x'.
* ``wait`` polls (base class): keyspace notifications are off by default in Redis
  and a name wait is rare, so polling keeps the server configuration untouched.

Every call has a socket timeout; an unreachable server is a ``NameResolveError``
naming ``host:port``. A password, if the server needs one, comes from the
environment (``REALFLOW_REDIS_PASSWORD``), never from name resolution itself.
A single Redis server (or a primary) is assumed; Redis Cluster is not supported
(SCAN and multi-key MGET/DEL would need per-slot handling).
"""
from __future__ import annotations

import json
import os
import re
import uuid
from typing import Any, Callable, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from realflow.base.name_resolve import NameExists, NameResolveError, NameResolver, in_subtree

DEFAULT_PORT = 6379
PASSWORD_ENV = "REALFLOW_REDIS_PASSWORD"
_BATCH = 500  # keys per MGET / DEL

# Re-arm the expiry only while the stored record is the one we wrote.
_REFRESH_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

T = TypeVar("T")


def glob_escape(s: str) -> str:
    """Escape Redis glob characters (``* ? [ ] \\``) so ``s`` matches only itself."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", s)


class RedisNameResolver(NameResolver):
    """Name resolution in a Redis server (see module docstring)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        namespace: str = "",
        timeout: float = 5.0,
        password: str | None = None,
    ) -> None:
        """``namespace`` is prepended to every Redis key, to share a database with other
        users; ``password`` defaults to $REALFLOW_REDIS_PASSWORD (unset: no AUTH)."""
        super().__init__()
        self.host, self.port, self.namespace, self.timeout = host, int(port), namespace, float(timeout)
        self._client = redis.Redis(
            host=host, port=self.port,
            password=password if password is not None else (os.environ.get(PASSWORD_ENV) or None),
            socket_timeout=self.timeout, socket_connect_timeout=self.timeout,
            decode_responses=True,
            # One immediate retry on a dropped connection (server restart, stale pooled
            # socket); none on timeouts, so a call never takes longer than ``timeout``.
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
        )
        self._refresh_script = self._client.register_script(_REFRESH_LUA)
        self._call("PING", self._client.ping)

    def describe(self) -> str:
        return f"redis at {self.host}:{self.port}" + (f" (namespace {self.namespace!r})" if self.namespace else "")

    # ---- transport ----------------------------------------------------------------
    def _call(self, what: str, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        try:
            return fn(*args, **kw)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
            if isinstance(e, (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError)):
                raise NameResolveError(
                    f"{self.describe()} rejected the login ({what}); set ${PASSWORD_ENV} to the "
                    f"server's password: {e}"
                ) from None
            raise NameResolveError(
                f"name_resolve.host/port: cannot reach redis at {self.host}:{self.port} within "
                f"{self.timeout:g}s ({what}): {e}"
            ) from None
        except redis.exceptions.RedisError as e:
            raise NameResolveError(f"{self.describe()} failed {what}: {e}") from None

    def _rkey(self, key: str) -> str:
        return self.namespace + key

    def _record(self, key: str, raw: str | None) -> str | None:
        if raw is None:
            return None
        try:
            return json.loads(raw)["value"]
        except (ValueError, KeyError, TypeError):
            raise NameResolveError(
                f"{self.describe()}: key '{self._rkey(key)}' is not a realflow name record "
                f"(written by something else?): {raw[:100]!r}"
            ) from None

    def _scan(self, prefix: str) -> list[str]:
        """Names (without namespace) of the live keys ``in_subtree(name, prefix)``."""
        pattern = glob_escape(self._rkey(prefix)) + "/*"
        found = set(self._call(f"SCAN '{pattern}'", lambda: list(
            self._client.scan_iter(match=pattern, count=1000))))
        if self._call(f"EXISTS '{self._rkey(prefix)}'", self._client.exists, self._rkey(prefix)):
            found.add(self._rkey(prefix))
        n = len(self.namespace)
        return [k[n:] for k in found if k.startswith(self.namespace) and in_subtree(k[n:], prefix)]

    # ---- backend hooks ------------------------------------------------------------
    def _add(self, key: str, value: str, ttl: float | None, replace: bool) -> str:
        rec = json.dumps({"owner": uuid.uuid4().hex, "value": value}, sort_keys=True)
        px = None if ttl is None else max(1, round(ttl * 1000))
        ok = self._call(f"SET '{key}'", self._client.set, self._rkey(key), rec, px=px, nx=not replace)
        if not ok:
            raise NameExists(key, self.describe())
        return rec  # the handle: refresh only while the stored record is exactly this

    def _get(self, key: str) -> str | None:
        return self._record(key, self._call(f"GET '{key}'", self._client.get, self._rkey(key)))

    def _get_subtree(self, prefix: str) -> dict[str, str]:
        names = self._scan(prefix)
        out: dict[str, str] = {}
        for i in range(0, len(names), _BATCH):
            batch = names[i:i + _BATCH]
            raws = self._call(f"MGET under '{prefix}'", self._client.mget, [self._rkey(k) for k in batch])
            for k, raw in zip(batch, raws):
                value = self._record(k, raw)
                if value is not None:  # expired between SCAN and MGET
                    out[k] = value
        return out

    def _delete(self, key: str) -> bool:
        return self._call(f"DEL '{key}'", self._client.delete, self._rkey(key)) > 0

    def _clear_subtree(self, prefix: str) -> int:
        names = self._scan(prefix)
        n = 0
        for i in range(0, len(names), _BATCH):
            batch = [self._rkey(k) for k in names[i:i + _BATCH]]
            n += self._call(f"DEL under '{prefix}'", self._client.delete, *batch)
        return n

    def _refresh(self, key: str, handle: str, ttl: float) -> bool:
        px = max(1, round(ttl * 1000))
        return bool(self._call(f"PEXPIRE '{key}'", self._refresh_script,
                               keys=[self._rkey(key)], args=[handle, px]))

    def close(self) -> None:
        super().close()
        self._client.close()
