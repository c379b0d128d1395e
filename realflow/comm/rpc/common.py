"""What both ends of the control plane share: errors, the request/reply types, socket
options and the framed send/receive helpers (see the package docstring for the protocol)."""
from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Self

import zmq


from realflow.comm import codec

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


#: frames at least this large are sent and received without copying (smaller ones are cheaper to copy)
ZERO_COPY_MIN_BYTES = 64 * 1024
SNDMORE = int(zmq.SNDMORE)  # plain ints: combining zmq's enum flags per frame costs microseconds
POLLIN = int(zmq.POLLIN)
NOBLOCK = int(zmq.NOBLOCK)


def receive(sock: zmq.Socket, timeout: float, n_copied: int) -> list | None:
    """One multipart message within ``timeout`` seconds (``RECV_SLICE_S`` at most), or None.

    Why a blocking receive bounded by the socket's RCVTIMEO (set to ``RECV_SLICE_S`` in
    ``make_socket``) rather than poll-then-receive: it makes fewer system calls per message,
    and on virtual machines each costs microseconds, a noticeable share of an empty MFC's
    round trip. Shorter waits go through ``zmq_poll`` (not ``zmq.Poller``: its Python
    wrapper of lists, dicts and enum flags costs several microseconds per call).
    """
    try:
        if timeout >= RECV_SLICE_S:
            return recv_frames(sock, n_copied, 0)
        if timeout > 0 and not zmq.zmq_poll([(sock, POLLIN)], int(timeout * 1000)):
            return None
        return recv_frames(sock, n_copied, NOBLOCK)
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
        sock.send(f, flags | SNDMORE if i < last else flags, copy=n < ZERO_COPY_MIN_BYTES)


def recv_frames(sock: zmq.Socket, n_copied: int, flags: int = NOBLOCK) -> list:
    """Receive one multipart message; the first ``n_copied`` parts (routing id, the signed frame with the codec
    header: small) as bytes, later parts (tensor buffers) as zero-copy ``zmq.Frame``s. ``flags`` apply to the
    first part (0 blocks for up to the socket's RCVTIMEO, then raises zmq.Again).

    Why ``Frame.more`` and not ``getsockopt(RCVMORE)``: pyzmq builds a Python enum from the
    option number on every getsockopt, which costs more than the receive itself.
    """
    frame = sock.recv(flags, copy=False)
    frames = [frame.bytes if n_copied else frame]
    while frame.more:  # the rest of a multipart message has arrived with its first part
        frame = sock.recv(NOBLOCK, copy=False)
        frames.append(frame.bytes if len(frames) < n_copied else frame)
    return frames


def make_socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.RCVTIMEO, int(RECV_SLICE_S * 1000))  # bounds a blocking receive (see receive())
    return sock


def error_text(exc: BaseException | str) -> str:
    if isinstance(exc, str):
        return exc
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def encode_message(msg: dict, what: Callable[[], str]) -> list:
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


class SocketEndpoint:
    """An object owning one ZMQ socket (``self._sock``): closed once, usable as a context manager."""

    _sock: zmq.Socket
    _closed: bool  # set False by the owner's __init__

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
