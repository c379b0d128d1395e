"""etcd v3 name resolution backend, spoken over etcd's JSON gateway with ``requests``.

Why the JSON gateway and not a gRPC client: the Python etcd clients (``etcd3``,
``python-etcd3``) ship protobuf code generated for protobuf 3.x and break with the
protobuf 5+/grpcio versions that the rest of the stack (transformers, tensorboard)
pulls in. Every etcd v3 server (3.4+) serves the same API as JSON over HTTP at
``/v3/...`` (keys and values base64-encoded, 64-bit ints as strings), and
``requests`` is already a dependency. A handful of calls cover everything we need:
range, put, txn (atomic create), deleterange, lease grant/keepalive/revoke, watch.

TTL keys are attached to a lease; the keep-alive thread refreshes the lease, and
when the owner dies etcd deletes the key when the lease runs out. etcd rounds TTLs
up to whole seconds and enforces a minimum (about 2 s with default settings).
``wait`` uses a watch that starts right after the revision at which the key was
seen missing, so a key created in between cannot be missed.
"""
from __future__ import annotations

import base64
import json
import math
import threading
from typing import Any

import requests

from realflow.base.name_resolve import (
    NameExists,
    NameResolveError,
    NameResolver,
    NameWaitTimeout,
    in_subtree,
    normalize_key,
)
from realflow.base.timeutil import Deadline, format_seconds


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _unb64(s: str) -> str:
    return base64.b64decode(s).decode()


def _range_end(prefix: str) -> str:
    """Smallest key greater than every key starting with ``prefix`` (etcd idiom)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1  # keys are validated ASCII, so the last byte is < 0x7f
    return base64.b64encode(bytes(raw)).decode()


class EtcdNameResolver(NameResolver):
    """Name resolution in etcd v3 (see module docstring)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 2379, request_timeout: float = 5.0) -> None:
        super().__init__()
        self.host, self.port = host, int(port)
        self._url = f"http://{host}:{self.port}/v3"
        self._timeout = request_timeout
        self._tls = threading.local()  # requests.Session is not thread-safe: one per thread
        status = self._call("/maintenance/status", {})
        self.server_version = status.get("version", "?")

    def describe(self) -> str:
        return f"etcd at {self.host}:{self.port}"

    # ---- transport ----------------------------------------------------------------
    def _session(self) -> requests.Session:
        s = getattr(self._tls, "session", None)
        if s is None:
            s = self._tls.session = requests.Session()
        return s

    def _call(self, path: str, body: dict, ok_codes: tuple[int, ...] = ()) -> dict:
        try:
            r = self._session().post(self._url + path, json=body, timeout=self._timeout)
        except requests.RequestException as e:
            raise NameResolveError(f"{self.describe()} unreachable ({path}): {e}") from None
        try:
            data = r.json()
        except ValueError:
            raise NameResolveError(
                f"{self.describe()} answered {path} with HTTP {r.status_code}, not JSON: {r.text[:200]!r}"
            ) from None
        if r.status_code != 200 or "error" in data:
            if data.get("code") in ok_codes:
                return data
            msg = data.get("message") or data.get("error") or r.text[:200]
            raise NameResolveError(f"{self.describe()} rejected {path}: {msg}")
        return data

    def _grant(self, ttl: float) -> str:
        return self._call("/lease/grant", {"TTL": max(1, math.ceil(ttl))})["ID"]

    def _revoke(self, lease: str) -> None:
        self._call("/lease/revoke", {"ID": lease}, ok_codes=(5,))  # 5 = NOT_FOUND: already gone

    # ---- backend hooks ------------------------------------------------------------
    def _add(self, key: str, value: str, ttl: float | None, replace: bool) -> str | None:
        lease = self._grant(ttl) if ttl is not None else None
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease is not None:
            put["lease"] = lease
        try:
            if replace:
                self._call("/kv/put", put)
            else:
                # Create only if the key has never been created (create_revision == 0):
                # atomic across all clients, unlike a get followed by a put.
                res = self._call("/kv/txn", {
                    "compare": [{"key": _b64(key), "target": "CREATE", "result": "EQUAL",
                                 "create_revision": "0"}],
                    "success": [{"request_put": put}],
                })
                if not res.get("succeeded", False):
                    raise NameExists(key, self.describe())
        except BaseException:
            if lease is not None:
                self._revoke(lease)
            raise
        return lease

    def _get(self, key: str) -> str | None:
        kvs = self._call("/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _unb64(kvs[0].get("value", "")) if kvs else None

    def _range_prefix(self, prefix: str, keys_only: bool = False) -> dict[str, str]:
        res = self._call("/kv/range", {"key": _b64(prefix), "range_end": _range_end(prefix),
                                       "keys_only": keys_only})
        out = {}
        for kv in res.get("kvs", []):
            k = _unb64(kv["key"])
            if in_subtree(k, prefix):  # the byte range also holds 'prefix0', 'prefix-x', ...
                out[k] = _unb64(kv.get("value", ""))
        return out

    def _get_subtree(self, prefix: str) -> dict[str, str]:
        return self._range_prefix(prefix)

    def find_subtree(self, prefix: str) -> list[str]:
        return sorted(self._range_prefix(normalize_key(prefix, "prefix"), keys_only=True))

    def _delete(self, key: str) -> bool:
        res = self._call("/kv/deleterange", {"key": _b64(key)})
        return int(res.get("deleted", "0")) > 0

    def _clear_subtree(self, prefix: str) -> int:
        n = int(self._call("/kv/deleterange", {"key": _b64(prefix)}).get("deleted", "0"))
        res = self._call("/kv/deleterange", {"key": _b64(prefix + "/"), "range_end": _range_end(prefix + "/")})
        return n + int(res.get("deleted", "0"))

    def _refresh(self, key: str, handle: str | None, ttl: float) -> bool:
        if handle is None:
            return False
        res = self._call("/lease/keepalive", {"ID": handle})
        # The gateway wraps stream messages in "result"; an expired lease has no TTL.
        return int(res.get("result", res).get("TTL", "0")) > 0

    def _release(self, handle: Any) -> None:
        if handle is not None:
            try:
                self._revoke(handle)
            except NameResolveError:
                pass  # the lease expires by itself anyway

    # ---- wait with a watch ----------------------------------------------------------
    def wait(self, key: str, timeout: float, poll_interval: float = 0.2) -> str:
        key = normalize_key(key)
        deadline = Deadline(timeout)

        def timed_out() -> NameWaitTimeout:
            return NameWaitTimeout(
                f"timed out after {format_seconds(deadline.elapsed())} waiting for name "
                f"'{key}' in {self.describe()}"
            )

        while True:
            res = self._call("/kv/range", {"key": _b64(key)})
            if res.get("kvs"):
                return _unb64(res["kvs"][0].get("value", ""))
            remaining = deadline.remaining()  # None: wait forever
            if deadline.expired():
                raise timed_out()
            read_timeout = None if remaining is None else max(0.05, remaining)
            start_rev = int(res["header"]["revision"]) + 1
            body = {"create_request": {"key": _b64(key), "start_revision": str(start_rev)}}
            try:
                with requests.post(self._url + "/watch", json=body, stream=True,
                                   timeout=(self._timeout, read_timeout)) as r:
                    for line in r.iter_lines():
                        if not line:
                            continue
                        msg = json.loads(line)
                        if "error" in msg:  # re-read and watch again, without spinning
                            deadline.sleep(0.1)
                            break
                        result = msg.get("result", {})
                        for ev in result.get("events", []):
                            if ev.get("type") != "DELETE":
                                return _unb64(ev["kv"].get("value", ""))
                        if result.get("canceled") or deadline.expired():
                            break
            except requests.RequestException as e:
                # The read timeout is the remaining time, so a timeout surfaces here
                # (as ReadTimeout or, mid-stream, as ConnectionError) once it expired.
                if deadline.expired():
                    raise timed_out() from None
                raise NameResolveError(f"{self.describe()} unreachable (watch '{key}'): {e}") from None
            if deadline.expired():
                raise timed_out()

    def close(self) -> None:
        super().close()
        s = getattr(self._tls, "session", None)
        if s is not None:
            s.close()
