"""Signed request/reply between the master (ZMQ ROUTER, binds) and workers (DEALER, connect).

Why this shape: one master talks to many workers and must never block on a slow
or dead one. ``request`` only queues a message (non-blocking send) and returns an
id; ``wait`` collects replies with a timeout and names exactly which worker,
handler and request id did not answer. Workers are addressed by their ZMQ
identity (= worker name), so the master needs no per-worker socket.

Every message is ``codec.encode``-d and signed by :mod:`realflow.comm.auth`; a
message that fails verification or decoding is dropped and logged with the sender
it claims to be, and the loop continues.

Message bodies (the codec object)::

    hello   worker -> master   {"k": "hello"}
    probe   master -> worker   {"k": "probe"}          (worker answers with hello)
    welcome master -> worker   {"k": "welcome"}
    req     master -> worker   {"k": "req", "id": int, "h": handler, "dl": deadline (time.time()), "p": payload}
    rep     worker -> master   {"k": "rep", "id": int, "ok": bool, "r": result | "e": error text, "x": expired}

Deadlines are absolute wall-clock times (hosts are assumed NTP-synced). A worker
that receives a request after its deadline answers "expired" without running it.

Zero copy: tensors, numpy arrays and ``codec.RawBuffer`` values travel as their
own frames and are sent with ``copy=False`` (pyzmq copies frames below 64 KiB,
which is cheaper for small ones). Do not modify a tensor passed to ``request`` or
``reply`` until the peer answered: ZMQ may still be reading it.

Endpoints are not thread-safe: use each from one thread (heartbeats have their own
sockets in :mod:`realflow.comm.heartbeat`).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import zmq

from realflow.comm import codec
from realflow.comm.auth import AuthError, Signer, Verifier, check_secret

__all__ = [
    "MasterEndpoint", "WorkerEndpoint", "Request", "ReplyThen", "RpcError", "RequestTimeout", "RemoteError",
    "WorkersMissing", "WorkerUnreachable",
]

logger = logging.getLogger(__name__)

DEFAULT_MASTER_NAME = "master"
#: messages queued per peer before a non-blocking send reports "queue full" instead of blocking
HWM = 100_000
#: how long close() may spend flushing queued messages
LINGER_MS = 1000
#: extra time after a request's deadline for its reply to arrive before ``wait`` gives up
DEADLINE_GRACE_S = 0.25
#: longest single blocking receive; waiters loop, re-checking their own deadlines in between
RECV_SLICE_S = 0.1


class RpcError(RuntimeError):
    """Base class of control-plane errors."""


class WorkerUnreachable(RpcError):
    """The master has no connection to the named worker."""


class RequestTimeout(RpcError, TimeoutError):
    """Requests that got no (timely) answer; ``missing`` lists (request_id, worker, handler)."""

    def __init__(self, message: str, missing: list[tuple[int, str, str]]) -> None:
        super().__init__(message)
        self.missing = missing


class RemoteError(RpcError):
    """The worker's handler raised; ``remote_traceback`` is the worker-side text."""

    def __init__(self, worker: str, handler: str, request_id: int, remote_traceback: str) -> None:
        super().__init__(f"worker {worker!r} handler {handler!r} (request {request_id}) raised:\n"
                         f"{remote_traceback.rstrip()}")
        self.worker = worker
        self.handler = handler
        self.request_id = request_id
        self.remote_traceback = remote_traceback


class WorkersMissing(RpcError, TimeoutError):
    """``wait_for_workers`` timed out; ``missing`` names who never said hello."""

    def __init__(self, message: str, missing: list[str]) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass
class Request:
    """A request as seen by the worker."""

    id: int
    handler: str
    payload: Any
    deadline: float  # time.time() after which the master no longer waits
    sender: str = DEFAULT_MASTER_NAME

    @property
    def remaining(self) -> float:
        return self.deadline - time.time()


@dataclass
class ReplyThen:
    """A handler result that is sent before ``then()`` runs.

    Why: bookkeeping that the reply does not depend on (e.g. indexing the outputs a
    worker keeps) then overlaps with the reply's trip and the master's handling of it
    instead of adding to the round trip. The next request is served only after
    ``then()`` returned. If it raises, the failure is logged and every later request
    is answered with it (the worker's state is no longer what the master believes).
    """

    result: Any
    then: Callable[[], None]


@dataclass
class _Pending:
    worker: str
    handler: str
    deadline: float


#: frames at least this large are sent and received without copying (smaller ones are cheaper to copy)
ZERO_COPY_MIN_BYTES = 64 * 1024
_SNDMORE = int(zmq.SNDMORE)  # plain ints: combining zmq's enum flags per frame costs microseconds
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)


def receive(sock: zmq.Socket, timeout: float, n_copied: int) -> list | None:
    """One multipart message within ``timeout`` seconds (``RECV_SLICE_S`` at most), or None.

    Why a blocking receive bounded by the socket's RCVTIMEO (set to ``RECV_SLICE_S`` in
    ``_socket``) rather than poll-then-receive: it makes fewer system calls per message,
    and on virtual machines each costs microseconds, a noticeable share of an empty MFC's
    round trip. Shorter waits go through ``zmq_poll`` (not ``zmq.Poller``: its Python
    wrapper of lists, dicts and enum flags costs several microseconds per call).
    """
    try:
        if timeout >= RECV_SLICE_S:
            return recv_frames(sock, n_copied, 0)
        if timeout > 0 and not zmq.zmq_poll([(sock, _POLLIN)], int(timeout * 1000)):
            return None
        return recv_frames(sock, n_copied, _NOBLOCK)
    except zmq.Again:
        return None


def send_frames(sock: zmq.Socket, frames: list, flags: int = 0) -> None:
    """send_multipart with a per-frame copy decision: zero copy (copy=False) only for big frames.

    With NOBLOCK only the first part can fail (ZMQ delivers multipart messages atomically).
    """
    flags = int(flags)
    last = len(frames) - 1
    for i, f in enumerate(frames):
        n = len(f) if type(f) is bytes else memoryview(f).nbytes
        sock.send(f, flags | _SNDMORE if i < last else flags, copy=n < ZERO_COPY_MIN_BYTES)


def recv_frames(sock: zmq.Socket, n_copied: int, flags: int = _NOBLOCK) -> list:
    """Receive one multipart message; the first ``n_copied`` parts (routing id, the signed frame with the codec
    header: small) as bytes, later parts (tensor buffers) as zero-copy ``zmq.Frame``s. ``flags`` apply to the
    first part (0 blocks for up to the socket's RCVTIMEO, then raises zmq.Again).

    Why ``Frame.more`` and not ``getsockopt(RCVMORE)``: pyzmq builds a Python enum from the
    option number on every getsockopt, which costs more than the receive itself.
    """
    frame = sock.recv(flags, copy=False)
    frames = [frame.bytes if n_copied else frame]
    while frame.more:  # the rest of a multipart message has arrived with its first part
        frame = sock.recv(_NOBLOCK, copy=False)
        frames.append(frame.bytes if len(frames) < n_copied else frame)
    return frames


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.RCVTIMEO, int(RECV_SLICE_S * 1000))  # bounds a blocking receive (see receive())
    return sock


class _DropLog:
    """Counts dropped messages and logs them without letting a flood spam the log."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.count = 0
        self._per_sender: dict[str, int] = {}

    def __call__(self, claimed: str | None, reason: str) -> None:
        self.count += 1
        key = claimed or "?"
        n = self._per_sender.get(key, 0) + 1
        if len(self._per_sender) < 10_000:
            self._per_sender[key] = n
        if n <= 10 or n % 1000 == 0:
            logger.warning("%s dropped a message claiming to be from %r: %s (%d dropped from it so far)",
                           self.who, claimed, reason, n)


def _error_text(exc: BaseException | str) -> str:
    if isinstance(exc, str):
        return exc
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def _encode(msg: dict, what: Callable[[], str]) -> list:
    """``codec.encode(msg)``; an unencodable payload/result raises TypeError naming ``what()`` and the path."""
    try:
        return codec.encode(msg)
    except TypeError:
        # re-run on the user part only, so the error names the path inside it
        try:
            codec.encode(msg.get("p", msg.get("r")))
        except TypeError as e:
            raise TypeError(f"{what()}: {str(e).replace(' at obj', ' at payload', 1)}") from None
        raise


class MasterEndpoint:
    """The master's side: one ROUTER socket that all workers connect to."""

    def __init__(self, secret: bytes, bind_host: str = "127.0.0.1", port: int = 0, *,
                 name: str = DEFAULT_MASTER_NAME, max_age: float = 120.0,
                 context: zmq.Context | None = None) -> None:
        self.name = name
        self._signer = Signer(check_secret(secret), name)
        self._verifier = Verifier(secret, name, max_age=max_age)
        self._sock = _socket(context or zmq.Context.instance(), zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown worker -> error, not a silent drop
        # No ROUTER_HANDOVER: an unauthenticated peer connecting with a live worker's name must not be able
        # to steal its routing. A dead worker's connection closes with its process, so a restart can reconnect.
        if port:
            self._sock.bind(f"tcp://{bind_host}:{port}")
        else:
            self._sock.bind(f"tcp://{bind_host}:*")
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._results: dict[int, tuple[bool, Any, bool]] = {}  # id -> (ok, result|error text, expired)
        self._workers: dict[str, bytes] = {}  # name -> worker session
        self._drop = _DropLog(f"master {name!r}")
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
        frames = _encode({"k": "req", "id": rid, "h": handler, "dl": deadline, "p": payload},
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

    def done(self, request_ids: Iterable[int]) -> bool:
        """True when every request in ``request_ids`` has a reply (or error) waiting to be collected."""
        return all(rid in self._results for rid in request_ids)

    def forget(self, request_ids: Iterable[int]) -> None:
        """Stop tracking requests (their late replies are dropped)."""
        for rid in request_ids:
            self._pending.pop(rid, None)
            self._results.pop(rid, None)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()

    def __enter__(self) -> "MasterEndpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

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


class WorkerEndpoint:
    """A worker's side: one DEALER socket (identity = worker name) connected to the master."""

    def __init__(self, name: str, master_address: str, secret: bytes, *,
                 master_name: str = DEFAULT_MASTER_NAME, max_age: float = 120.0,
                 hello_interval: float = 1.0, send_timeout: float = 10.0,
                 context: zmq.Context | None = None) -> None:
        if not isinstance(name, str) or not name or len(name.encode()) > 255 or name == master_name:
            raise ValueError(f"worker name must be a non-empty str of <= 255 bytes other than {master_name!r}, "
                             f"got {name!r}")
        self.name = name
        self.master_address = master_address
        self.master_name = master_name
        self._signer = Signer(check_secret(secret), name)
        self._verifier = Verifier(secret, name, max_age=max_age)
        self._sock = _socket(context or zmq.Context.instance(), zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, name.encode())
        self._sock.connect(master_address)
        self._hello_interval = hello_interval
        self._send_timeout = send_timeout
        self._welcomed = False
        self._last_hello = 0.0
        self._drop = _DropLog(f"worker {name!r}")
        self._closed = False
        self._say_hello()

    @property
    def dropped(self) -> int:
        return self._drop.count

    @property
    def welcomed(self) -> bool:
        """True once the master acknowledged our hello."""
        return self._welcomed

    def poll(self, timeout: float = 0.0) -> Request | None:
        """Wait up to ``timeout`` seconds for the next live request; None if there is none.

        Expired requests are answered with an "expired" error here and never returned.
        """
        end = time.monotonic() + timeout
        wait = timeout  # (the first wait is exactly ``timeout``: a full slice blocks in one receive)
        while True:
            if not self._welcomed:
                if time.monotonic() - self._last_hello >= self._hello_interval:
                    self._say_hello()
                wait = min(wait, self._hello_interval)
            frames = receive(self._sock, wait, 1)
            if frames is not None:
                req = self._handle(frames)
                if req is not None:
                    return req
            wait = end - time.monotonic()
            if wait <= 0 and frames is None:  # time is up and nothing more is queued
                return None

    def reply(self, request: Request, result: Any) -> None:
        """Send the handler's result back (an unencodable result is reported as an error instead)."""
        try:
            frames = _encode({"k": "rep", "id": request.id, "ok": True, "r": result},
                             lambda: f"result of handler {request.handler!r} on worker {self.name!r}")
        except TypeError as e:
            return self.reply_error(request, e)
        self._send(frames, lambda: f"reply to request {request.id}")

    def reply_error(self, request: Request, exc: BaseException | str) -> None:
        """Report a failure of ``request``; the master raises RemoteError with this text."""
        self._send(codec.encode({"k": "rep", "id": request.id, "ok": False, "e": _error_text(exc)}),
                   lambda: f"error reply to request {request.id}")

    def serve(self, handlers: Mapping[str, Callable[[Any], Any]], stop_event: threading.Event,
              poll_interval: float = 0.1) -> None:
        """Answer requests with ``handlers[name](payload)`` until ``stop_event`` is set.

        A handler exception goes back as RemoteError text; the loop keeps serving. A
        handler may return :class:`ReplyThen` to run bookkeeping after its reply is sent.
        """
        broken: str | None = None  # why deferred work failed: every later request is refused with it
        while not stop_event.is_set():
            req = self.poll(poll_interval)
            if req is None:
                continue
            fn = handlers.get(req.handler)
            if broken is not None or fn is None:
                self.reply_error(req, broken or f"worker {self.name!r} has no handler {req.handler!r} "
                                                f"(known: {sorted(handlers)})")
                continue
            try:
                result = fn(req.payload)
            except Exception as e:  # noqa: BLE001 - reported to the master, the loop lives on
                try:
                    self.reply_error(req, e)
                except RpcError as send_err:
                    logger.error("worker %r: %s", self.name, send_err)
                continue
            then = None
            if type(result) is ReplyThen:
                result, then = result.result, result.then
            try:
                self.reply(req, result)
            except RpcError as send_err:
                logger.error("worker %r: %s", self.name, send_err)
            if then is not None:
                try:
                    then()
                except Exception as e:  # noqa: BLE001 - the master learns it from the next request
                    logger.exception("worker %r: work after replying to request %d (%r) failed",
                                     self.name, req.id, req.handler)
                    broken = (f"worker {self.name!r} is unusable: work after replying to request {req.id} "
                              f"({req.handler!r}) failed:\n{_error_text(e)}")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()

    def __enter__(self) -> "WorkerEndpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _say_hello(self) -> None:
        self._last_hello = time.monotonic()
        try:
            self._send(codec.encode({"k": "hello"}), lambda: "hello", timeout=0.0)
        except RpcError:
            pass  # retried on the next poll until welcomed

    def _send(self, frames: list, what: Callable[[], str], timeout: float | None = None) -> None:
        signed = self._signer.sign(frames, to=self.master_name)
        end = None
        while True:
            try:
                send_frames(self._sock, signed, _NOBLOCK)
                return
            except zmq.Again:
                if end is None:
                    end = time.monotonic() + (self._send_timeout if timeout is None else timeout)
                left = end - time.monotonic()
                if left <= 0:
                    raise RpcError(f"worker {self.name!r}: {what()} not sent: queue to master {self.master_address} "
                                   f"full ({HWM} messages) for {self._send_timeout}s") from None
                self._sock.poll(int(min(left, 0.1) * 1000) + 1, zmq.POLLOUT)

    def _handle(self, frames: list) -> Request | None:
        try:
            env, payload = self._verifier.verify(frames)
        except AuthError as e:
            self._drop(e.claimed_sender, e.reason)
            return None
        try:
            msg = codec.decode(payload)
            kind = msg["k"]
        except (codec.CodecError, TypeError, KeyError) as e:
            self._drop(env.sender, f"undecodable body: {e}")
            return None
        if kind == "req":
            try:
                req = Request(int(msg["id"]), str(msg["h"]), msg.get("p"), float(msg["dl"]), env.sender)
            except (KeyError, TypeError, ValueError) as e:
                self._drop(env.sender, f"malformed request: {e!r}")
                return None
            late = time.time() - req.deadline
            if late > 0:
                logger.warning("worker %r: request %d (%r) arrived %.3fs after its deadline; not run",
                               self.name, req.id, req.handler, late)
                self._send(codec.encode({"k": "rep", "id": req.id, "ok": False, "x": True,
                                         "e": f"expired {late:.3f}s before worker {self.name!r} received it"}),
                           lambda: f"expiry reply to request {req.id}")
                return None
            return req
        if kind == "welcome":
            self._welcomed = True
        elif kind == "probe":
            self._say_hello()
        else:
            self._drop(env.sender, f"unexpected message kind {kind!r}")
        return None
