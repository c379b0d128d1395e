"""Signed heartbeats on their own sockets (worker PUB -> monitor SUB).

Why separate sockets and threads: a worker busy in a long handler must still be
seen alive, and the request/reply sockets are not thread-safe. PUB never blocks
(it drops when a queue is full), so a stuck monitor can never stall a worker.

A worker runs ``Heartbeater(name, monitor.address, secret).start()``; the monitor
(the master or the launcher) binds a SUB socket, verifies each beat with the
experiment secret, and reports ``lost_workers()``: the expected or previously seen
workers whose last valid beat is older than ``timeout`` seconds. A worker that
stops its heartbeater cleanly says "bye" and is no longer tracked.

Caveat: beats are sent from a Python thread, so a worker whose main thread holds
the GIL for longer than ``timeout`` (a C extension that never releases it) looks
lost. torch ops release the GIL.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable

import zmq

from realflow.base.network import host_address
from realflow.comm import codec
from realflow.comm.auth import AuthError, Signer, Verifier, check_secret
from realflow.comm.drop_log import DropLog

__all__ = ["Heartbeater", "HeartbeatMonitor", "DEFAULT_INTERVAL", "DEFAULT_TIMEOUT"]

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL = 1.0
DEFAULT_TIMEOUT = 5.0
DEFAULT_MONITOR_NAME = "monitor"
_HWM = 10_000


class Heartbeater:
    """Worker side: sends a signed beat every ``interval`` seconds from a daemon thread."""

    def __init__(self, name: str, monitor_address: str, secret: bytes, interval: float = DEFAULT_INTERVAL, *,
                 monitor_name: str = DEFAULT_MONITOR_NAME, status: Callable[[], Any] | None = None,
                 context: zmq.Context | None = None) -> None:
        if interval <= 0:
            raise ValueError(f"heartbeat interval must be > 0, got {interval}")
        self.name = name
        self.monitor_address = monitor_address
        self.interval = float(interval)
        self._monitor_name = monitor_name
        self._status = status
        self._secret = check_secret(secret)
        self._ctx = context or zmq.Context.instance()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.beats_sent = 0

    def start(self) -> "Heartbeater":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"heartbeat-{self.name}", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Say bye and stop the thread (the monitor then stops tracking this worker)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("heartbeat thread of %r did not stop within %.1fs", self.name, timeout)

    def __enter__(self) -> "Heartbeater":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _run(self) -> None:
        signer = Signer(self._secret, self.name)
        sock = self._ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 200)
        sock.setsockopt(zmq.SNDHWM, _HWM)
        sock.connect(self.monitor_address)
        try:
            while True:
                stopping = self._stop.is_set()
                body: dict[str, Any] = {"k": "bye" if stopping else "beat"}
                if self._status is not None and not stopping:
                    try:
                        body["st"] = self._status()
                    except Exception as e:  # noqa: BLE001 - a broken status callback must not stop the beat
                        body["st"] = {"status_error": repr(e)}
                try:
                    frames = codec.encode(body)
                except TypeError as e:
                    logger.error("heartbeat %r: status not encodable: %s", self.name, e)
                    frames = codec.encode({"k": body["k"]})
                try:
                    sock.send_multipart(signer.sign(frames, to=self._monitor_name), flags=zmq.NOBLOCK)
                    self.beats_sent += 1
                except zmq.ZMQError as e:
                    logger.debug("heartbeat %r not sent: %s", self.name, e)
                if stopping:
                    return
                self._stop.wait(self.interval)  # wakes early on stop(); the next round says bye
        finally:
            sock.close()


class HeartbeatMonitor:
    """Binds a SUB socket, verifies beats in a daemon thread and tracks when each worker was last seen."""

    def __init__(self, secret: bytes, bind_host: str | None = None, port: int = 0,
                 timeout: float = DEFAULT_TIMEOUT, *, name: str = DEFAULT_MONITOR_NAME, max_age: float = 120.0,
                 context: zmq.Context | None = None) -> None:
        self.timeout = float(timeout)
        self.name = name
        self._verifier = Verifier(secret, name, max_age=max_age)
        sock = (context or zmq.Context.instance()).socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, _HWM)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        bind_host = bind_host or host_address()  # loopback unless a cluster job (REALFLOW_CLUSTER=1)
        sock.bind(f"tcp://{bind_host}:{port}" if port else f"tcp://{bind_host}:*")
        self.address: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock  # handed to the thread below, never used here again
        self._lock = threading.Lock()
        self._last_mono: dict[str, float] = {}
        self._last_wall: dict[str, float] = {}
        self._status: dict[str, Any] = {}
        self._expected_since: dict[str, float] = {}
        self._left: set[str] = set()
        # When the monitor thread last found its socket empty: beats older than this have all been
        # counted. Silence is judged against it, not against "now", so a monitor thread starved of
        # the GIL or the CPU (a long C call in the owning process, an overloaded host) makes the
        # verdict wait instead of declaring live workers lost on beats it simply has not read yet.
        self._drained_mono = time.monotonic()
        self._drop = DropLog("heartbeat monitor", "beat")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat-monitor", daemon=True)
        self._thread.start()

    def expect(self, names: Iterable[str]) -> None:
        """Track these workers even before their first beat (lost if none arrives within ``timeout``)."""
        now = time.monotonic()
        with self._lock:
            for n in names:
                self._expected_since.setdefault(n, now)
                self._left.discard(n)

    def forget(self, name: str) -> None:
        with self._lock:
            for d in (self._last_mono, self._last_wall, self._status, self._expected_since):
                d.pop(name, None)

    @property
    def dropped(self) -> int:
        """Beats dropped (unsigned, forged, garbled); logged rate-limited per claimed sender."""
        return self._drop.count

    def lost_workers(self) -> list[str]:
        """Expected or seen workers without a valid beat for more than ``timeout`` seconds of the
        monitor's reading time (up to its last drain of the socket: see ``_drained_mono``)."""
        with self._lock:
            ref = self._drained_mono
            names = (set(self._expected_since) | set(self._last_mono)) - self._left
            return sorted(n for n in names
                          if ref - self._last_mono.get(n, self._expected_since.get(n, ref)) > self.timeout)

    def last_seen(self, worker: str) -> float | None:
        """``time.time()`` when the last valid beat of ``worker`` arrived; None if never."""
        with self._lock:
            return self._last_wall.get(worker)

    def status(self, worker: str) -> Any:
        """The status payload of the worker's last beat (None if none)."""
        with self._lock:
            return self._status.get(worker)

    def left_workers(self) -> set[str]:
        """Workers that stopped their heartbeater cleanly."""
        with self._lock:
            return set(self._left)

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def __enter__(self) -> "HeartbeatMonitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _run(self) -> None:
        sock = self._sock
        try:
            while not self._stop.is_set():
                if sock.poll(100, zmq.POLLIN):
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle(frames)
                drained = time.monotonic()  # taken after the socket was found empty
                with self._lock:
                    self._drained_mono = drained
        finally:
            sock.close()

    def _handle(self, frames: list[bytes]) -> None:
        try:
            env, payload = self._verifier.verify(frames)
            body = codec.decode(payload)
            kind = body["k"]
        except (AuthError, codec.CodecError, TypeError, KeyError) as e:
            self._drop(getattr(e, "claimed_sender", None), str(e))
            return
        with self._lock:
            if kind == "bye":
                self._left.add(env.sender)
                self._expected_since.pop(env.sender, None)
                self._last_mono.pop(env.sender, None)
                logger.info("heartbeat: worker %r stopped its heartbeat cleanly", env.sender)
                return
            self._left.discard(env.sender)
            self._last_mono[env.sender] = time.monotonic()
            self._last_wall[env.sender] = time.time()
            if "st" in body:
                self._status[env.sender] = body["st"]
