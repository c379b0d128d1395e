"""A model worker's trajectory inbox: where rollout workers deliver finished rollouts.

Asynchronous PPO's trainer starts from a stream of trajectories instead of a data
set. Each trainer model worker binds a ZMQ PULL socket (loopback unless the cluster
config says otherwise) and a thread receives signed messages on it: the one-sample
batch of a rollout, msgpack header plus raw tensor frames, verified with the
experiment secret before it is decoded (an unsigned or forged message is dropped and
logged). Received rollouts wait in a buffer; the master lists them (``peek``) and
moves the ones it picks into the worker's data manager (``take``), after which they
are ordinary samples of the step, staged to other workers like any other.
"""
from __future__ import annotations

import itertools
import threading
from typing import Any, Iterable

import zmq

from realflow.api.batch import SequenceBatch
from realflow.api.rollout import VERSION_ADMIT, VERSION_NEWEST, VERSION_OLDEST
from realflow.base.logging import get_logger
from realflow.base.network import host_address
from realflow.comm.auth import AuthError, Verifier
from realflow.comm.drop_log import DropLog
from realflow.comm.codec import CodecError, decode

__all__ = ["TrajectoryInbox"]

logger = get_logger("trajectory_inbox")


class TrajectoryInbox:
    def __init__(self, name: str, secret: bytes, bind_host: str | None = None) -> None:
        bind_host = bind_host or host_address()  # loopback unless a cluster job (REALFLOW_CLUSTER=1)
        self.name = name
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{bind_host}")
        self.address = f"tcp://{bind_host}:{port}"
        self._verifier = Verifier(secret, name)
        self._lock = threading.Lock()
        self._buffer: dict[str, tuple[int, SequenceBatch]] = {}  # id -> (arrival seq, batch)
        self._seq = itertools.count()
        self.received = 0
        self._drop = DropLog(f"{name} trajectory inbox", "trajectory message")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trajectory-inbox", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Messages dropped (unsigned, forged, not one rollout, a duplicate id); logged rate-limited."""
        return self._drop.count

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._sock.recv_multipart(copy=False)
            try:
                env, payload = self._verifier.verify(frames)
                batch = SequenceBatch.from_wire(decode(payload))
                if len(batch) != 1 or VERSION_ADMIT not in batch.metadata:
                    raise ValueError(f"expected one rollout with its versions, got {len(batch)} samples "
                                     f"and metadata {sorted(batch.metadata)}")
            except AuthError as e:
                self._drop(e.claimed_sender, e.reason)
                continue
            except (CodecError, ValueError, KeyError, TypeError) as e:
                self._drop(env.sender, f"undecodable or not one rollout: {e}")
                continue
            with self._lock:
                if batch.ids[0] in self._buffer:
                    self._drop(env.sender, f"a second trajectory with id {batch.ids[0]}")
                    continue
                self._buffer[batch.ids[0]] = (next(self._seq), batch)
                self.received += 1

    def peek(self) -> list[dict[str, Any]]:
        """What is buffered: id, arrival order and the rollout's versions (admission, oldest, newest token)."""
        with self._lock:
            items = list(self._buffer.items())
        return [{"id": sid, "seq": seq, "admit": int(b.metadata[VERSION_ADMIT][0]),
                 "oldest": int(b.metadata[VERSION_OLDEST][0]), "newest": int(b.metadata[VERSION_NEWEST][0])}
                for sid, (seq, b) in items]

    def take(self, ids: Iterable[str]) -> SequenceBatch:
        """Remove ``ids`` from the buffer and return them as one batch (in the order given)."""
        ids = list(ids)
        with self._lock:
            missing = [i for i in ids if i not in self._buffer]
            if missing:
                raise KeyError(f"{self.name}: trajectories {missing[:5]} are not in the inbox")
            parts = [self._buffer.pop(i)[1] for i in ids]
        return SequenceBatch.gather(parts)

    def __len__(self) -> int:
        with self._lock:
            return len(self._buffer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._sock.close(0)
