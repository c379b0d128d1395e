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

Layout: ``common`` (errors, request/reply types, framed send/receive), ``master``
(:class:`MasterEndpoint`), ``worker`` (:class:`WorkerEndpoint`).
"""
from realflow.comm.rpc.common import (
    DEFAULT_MASTER_NAME, Request, ReplyThen, RemoteError, RequestTimeout, RpcError, WorkersMissing, WorkerUnreachable,
)
from realflow.comm.rpc.master import MasterEndpoint
from realflow.comm.rpc.worker import WorkerEndpoint

__all__ = [
    "MasterEndpoint", "WorkerEndpoint", "Request", "ReplyThen", "RpcError", "RequestTimeout", "RemoteError",
    "WorkersMissing", "WorkerUnreachable", "DEFAULT_MASTER_NAME",
]
