"""The master's end of the control plane: one ROUTER socket that every worker connects to."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import zmq

from realflow.base.network import host_address
from realflow.comm import codec
from realflow.comm.drop_log import DropLog
from realflow.comm.auth import AuthError, Signer, Verifier, check_secret
from realflow.comm.rpc.common import (
    DEADLINE_GRACE_S, DEFAULT_MASTER_NAME, HWM, RemoteError, RequestTimeout, RpcError, SocketEndpoint,
    WorkersMissing, WorkerUnreachable, encode_message, make_socket, receive, send_frames,
)

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    worker: str
    handler: str
    deadline: float


class MasterEndpoint(SocketEndpoint):
    """The master's side: one ROUTER socket that all workers connect to."""

    def __init__(self, secret: bytes, bind_host: str | None = None, port: int = 0, *,
                 name: str = DEFAULT_MASTER_NAME, max_age: float = 120.0,
                 context: zmq.Context | None = None) -> None:
        self.name = name
        self._signer = Signer(check_secret(secret), name)
        self._verifier = Verifier(secret, name, max_age=max_age)
        self._sock = make_socket(context or zmq.Context.instance(), zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown worker -> error, not a silent drop
        # No ROUTER_HANDOVER: an unauthenticated peer connecting with a live worker's name must not be able
        # to steal its routing. A dead worker's connection closes with its process, so a restart can reconnect.
        bind_host = bind_host or host_address()  # loopback unless a cluster job (REALFLOW_CLUSTER=1)
        if port:
            self._sock.bind(f"tcp://{bind_host}:{port}")
        else:
            self._sock.bind(f"tcp://{bind_host}:*")
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._results: dict[int, tuple[bool, Any, bool]] = {}  # id -> (ok, result|error text, expired)
        self._workers: dict[str, bytes] = {}  # name -> worker session
        self._drop = DropLog(f"master {name!r}")
        self._closed = False

    # ------------------------------------------------------------------ public API
    @property
    def workers(self) -> set[str]:
        """Names of workers that said hello."""
        return set(self._workers)

    @property
    def dropped(self) -> int:
        """How many incoming messages were dropped (bad signature, garbled, replayed...)."""
        return self._drop.count

    def request(self, worker: str, handler: str, payload: Any = None, timeout: float = 60.0) -> int:
        """Queue a request to ``worker`` (non-blocking) and return its id."""
        if not isinstance(handler, str) or not handler:
            raise ValueError(f"handler must be a non-empty str, got {handler!r}")
        if not timeout or timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        rid = next(self._ids)
        deadline = time.time() + timeout
        # (error texts are built only on failure: formatting them costs microseconds on every call)
        frames = encode_message({"k": "req", "id": rid, "h": handler, "dl": deadline, "p": payload},
                         lambda: f"request {handler!r} to worker {worker!r}")
        self._send(worker, frames, lambda: f"request {handler!r} (id {rid})")
        self._pending[rid] = _Pending(worker, handler, deadline)
        return rid

    def wait(self, request_ids: Iterable[int], timeout: float | None = None) -> dict[int, Any]:
        """Collect the results of ``request_ids``.

        Raises RemoteError as soon as one of them failed on the worker, and RequestTimeout
        when ``timeout`` elapsed or a request's own deadline passed without a reply (naming
        every request that did not answer). Results of the other requests stay collectable.
        """
        ids = list(dict.fromkeys(request_ids))
        results = self._results
        if all(rid in results for rid in ids):  # all answered (the usual call, after done()): no waiting
            self._raise_failed(ids)
            for rid in ids:
                self._pending.pop(rid, None)
            return {rid: results.pop(rid)[1] for rid in ids}
        for rid in ids:
            if rid not in self._pending and rid not in self._results:
                raise ValueError(f"unknown request id {rid!r} (never issued, or already collected)")
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            self._raise_failed(ids)
            missing = [rid for rid in ids if rid not in self._results]
            if not missing:
                for rid in ids:
                    self._pending.pop(rid, None)
                return {rid: self._results.pop(rid)[1] for rid in ids}
            now_wall, now = time.time(), time.monotonic()
            overdue = [rid for rid in missing if self._pending[rid].deadline + DEADLINE_GRACE_S < now_wall]
            if overdue:
                self._timeout(overdue, f"before the request deadline (+{DEADLINE_GRACE_S}s grace)")
            if end is not None and now >= end:
                self._timeout(missing, f"within the wait timeout of {timeout}s")
            next_deadline = min(self._pending[rid].deadline for rid in missing) + DEADLINE_GRACE_S - now_wall
            slack = next_deadline if end is None else min(end - now, next_deadline)
            self._pump(max(0.0, slack))

    def call(self, worker: str, handler: str, payload: Any = None, timeout: float = 60.0) -> Any:
        """request + wait for one reply."""
        rid = self.request(worker, handler, payload, timeout)
        return self.wait([rid])[rid]

    def wait_for_workers(self, names: Iterable[str], timeout: float) -> None:
        """Block until every named worker said hello; WorkersMissing names those that did not."""
        names = list(names)
        end = time.monotonic() + timeout
        next_probe = 0.0
        while True:
            missing = [n for n in names if n not in self._workers]
            if not missing:
                return
            now = time.monotonic()
            if now >= end:
                raise WorkersMissing(
                    f"master at {self.address}: no hello within {timeout}s from worker(s) {missing} "
                    f"(registered: {sorted(self._workers)})", missing)
            if now >= next_probe:  # a worker connected before a (re)started master asks it to say hello again
                for n in missing:
                    self._try_send(n, codec.encode({"k": "probe"}))
                next_probe = now + 0.5
            self._pump(min(end, next_probe) - now)

    def poll(self, timeout: float = 0.0) -> None:
        """Wait up to ``timeout`` seconds for incoming messages (hellos, replies); process every one queued."""
        if self._pump(timeout):
            while self._pump(0.0):
                pass

    def poll_once(self, timeout: float = 0.0) -> bool:
        """Wait up to ``timeout`` seconds for one incoming message and process it; False if none came.

        For loops that check their own condition (``done``) after every message.
        """
        return self._pump(timeout)

    def any_failed(self, request_ids: Iterable[int]) -> bool:
        """True when one of ``request_ids`` has an error reply waiting (``wait`` raises it)."""
        results = self._results
        return any(rid in results and not results[rid][0] for rid in request_ids)

    def done(self, request_ids: Iterable[int]) -> bool:
        """True when every request in ``request_ids`` has a reply (or error) waiting to be collected."""
        return all(rid in self._results for rid in request_ids)

    def workers_of(self, request_ids: Iterable[int]) -> set[str]:
        """The workers that requests in ``request_ids`` (issued, not yet collected) were sent to."""
        pending = self._pending
        return {pending[rid].worker for rid in request_ids if rid in pending}

    def forget(self, request_ids: Iterable[int]) -> None:
        """Stop tracking requests (their late replies are dropped)."""
        for rid in request_ids:
            self._pending.pop(rid, None)
            self._results.pop(rid, None)

    # ------------------------------------------------------------------ internals
    def _send(self, worker: str, frames: list, what: Callable[[], str]) -> None:
        signed = self._signer.sign(frames, to=worker)
        try:
            send_frames(self._sock, [worker.encode(), *signed], zmq.NOBLOCK)
        except zmq.Again:
            raise RpcError(f"{what()}: send queue to worker {worker!r} is full ({HWM} messages); "
                           "is the worker alive and reading?") from None
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                raise WorkerUnreachable(f"{what()}: worker {worker!r} is not connected to master at {self.address} "
                                        f"(registered: {sorted(self._workers)})") from None
            raise

    def _try_send(self, worker: str, frames: list) -> None:
        try:
            send_frames(self._sock, [worker.encode(), *self._signer.sign(frames, to=worker)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # not connected (yet): that is what we are finding out

    def _raise_failed(self, ids: list[int]) -> None:
        for rid in ids:
            res = self._results.get(rid)
            if res is not None and not res[0]:
                p = self._pending.pop(rid)
                self._results.pop(rid)
                if res[2]:
                    raise RequestTimeout(f"worker {p.worker!r} received request {rid} (handler {p.handler!r}) after "
                                         f"its deadline and did not run it: {res[1]}", [(rid, p.worker, p.handler)])
                raise RemoteError(p.worker, p.handler, rid, res[1])

    def _timeout(self, rids: list[int], why: str) -> None:
        missing = [(rid, self._pending[rid].worker, self._pending[rid].handler) for rid in rids]
        for rid in rids:
            self._pending.pop(rid)
        detail = ", ".join(f"worker {w!r} handler {h!r} request {rid}" for rid, w, h in missing)
        raise RequestTimeout(f"no reply {why} from: {detail}", missing)

    def _pump(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for one message and handle it; False if none came.

        One message per call: every caller loops until what it waits for has arrived, so
        draining here would only add a check for more on every reply.
        """
        frames = receive(self._sock, timeout, 2)
        if frames is None:
            return False
        self._handle(frames)
        return True

    def _handle(self, frames: list) -> None:
        identity = frames[0].decode(errors="replace")
        try:
            env, payload = self._verifier.verify(frames[1:])
        except AuthError as e:
            self._drop(e.claimed_sender or f"<identity {identity}>", e.reason)
            return
        if env.sender != identity:
            self._drop(env.sender, f"signed as {env.sender!r} but connected as {identity!r}")
            return
        try:
            msg = codec.decode(payload)
            kind = msg["k"]
        except (codec.CodecError, TypeError, KeyError) as e:
            self._drop(env.sender, f"undecodable body: {e}")
            return
        if kind == "rep":
            rid = msg.get("id")
            p = self._pending.get(rid)
            if p is None:
                logger.debug("master: late or unknown reply %r from %r dropped", rid, identity)
            elif p.worker != identity:
                self._drop(identity, f"reply to request {rid} that was sent to {p.worker!r}")
            elif msg.get("ok"):
                self._results[rid] = (True, msg.get("r"), False)
            else:
                self._results[rid] = (False, str(msg.get("e")), bool(msg.get("x")))
        elif kind == "hello":
            if self._workers.get(identity) != env.session:
                logger.info("master: worker %r said hello", identity)
            self._workers[identity] = env.session
            self._try_send(identity, codec.encode({"k": "welcome"}))
        else:
            self._drop(identity, f"unexpected message kind {kind!r}")
