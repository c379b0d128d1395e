"""A worker's end of the control plane: one DEALER socket, named after the worker, connected to the master."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Mapping

import zmq

from realflow.comm import codec
from realflow.comm.drop_log import DropLog
from realflow.comm.auth import AuthError, Signer, Verifier, check_secret
from realflow.comm.rpc.common import (
    DEFAULT_MASTER_NAME, HWM, NOBLOCK, ReplyThen, Request, RpcError, SocketEndpoint, encode_message, error_text,
    make_socket, receive, send_frames,
)

logger = logging.getLogger(__name__)


class WorkerEndpoint(SocketEndpoint):
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
        self._sock = make_socket(context or zmq.Context.instance(), zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, name.encode())
        self._sock.connect(master_address)
        self._hello_interval = hello_interval
        self._send_timeout = send_timeout
        self._welcomed = False
        self._last_hello = 0.0
        self._drop = DropLog(f"worker {name!r}")
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
            frames = encode_message({"k": "rep", "id": request.id, "ok": True, "r": result},
                             lambda: f"result of handler {request.handler!r} on worker {self.name!r}")
        except TypeError as e:
            return self.reply_error(request, e)
        self._send(frames, lambda: f"reply to request {request.id}")

    def reply_error(self, request: Request, exc: BaseException | str) -> None:
        """Report a failure of ``request``; the master raises RemoteError with this text."""
        self._send(codec.encode({"k": "rep", "id": request.id, "ok": False, "e": error_text(exc)}),
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
                              f"({req.handler!r}) failed:\n{error_text(e)}")

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
                send_frames(self._sock, signed, NOBLOCK)
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
