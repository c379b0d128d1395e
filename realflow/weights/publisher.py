"""The trainer's side of a memory publish: shared memory for this host, a broadcast for the others.

One :class:`WeightPublisher` per model worker that writes a policy's weights (dp 0,
tp 0, pp 0 of its home ranks). The model worker's ``publish_weights`` handler gathers
the full HF-named state and hands it here; disk publishes are the interface's ``save``
and do not come here.
"""
from __future__ import annotations

import socket
from typing import Any, Optional

import torch

from realflow.comm import shm
from realflow.weights.broadcast_writer import WeightSender
from realflow.weights.delta import BLOCK_BYTES, DeltaWriter

__all__ = ["WeightPublisher"]


class WeightPublisher:
    """Owns the pre-faulted shared-memory pool and the broadcast writer of one model worker.

    ``segment_prefix`` names the run's shared-memory segments; ``bind`` is the address
    the broadcast group's connections use (the worker's host address); ``block_bytes``: the
    granularity of delta updates (:mod:`realflow.weights.delta`).
    """

    def __init__(self, segment_prefix: str, bind: str, block_bytes: int = BLOCK_BYTES) -> None:
        self.segment_prefix, self.bind, self.block_bytes = segment_prefix, bind, block_bytes
        self._wpool: Optional[shm.ShmPool] = None
        self._sender: Optional[WeightSender] = None  # broadcasts to servers on other hosts
        self._delta: Optional[DeltaWriter] = None  # digests of the last version (delta sync)

    def publish(self, state: dict[str, torch.Tensor], version: int, group: Optional[dict[str, Any]],
                to_shm: bool, delta: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """Publish ``state`` as ``version``: broadcast it to ``group`` (a ``GroupSpec`` on the wire,
        from the controller's plan) and/or put it in shared memory (``to_shm``: servers on this host).

        ``delta`` (the plan's, None when delta sync is off): ``{"mode", "shm", "group"}``, the
        version the receivers of each way hold as a delta base (None: they need a full update);
        each way then carries a manifest (:mod:`realflow.weights.delta`) and, where the writer's
        last version is that base, only the changed blocks.

        Returns the writer's reply: ``handle`` (the segment, or None), ``host``, with a group
        ``broadcast`` (what the receivers need to join and load it; ``delta``: its manifest),
        ``shm_delta`` (the segment's manifest) and ``weight_bytes`` (sent vs full, per way used).
        """
        reply: dict[str, Any] = {"handle": None, "host": socket.gethostname()}
        prep = None
        if delta is not None:
            if self._delta is None:
                self._delta = DeltaWriter(self.block_bytes)
            prep = self._delta.prepare(state, version)
        full = sum(t.numel() * t.element_size() for t in state.values())
        sent = {"sent": 0, "full": 0, "delta_ways": 0}

        def message(base: Optional[int]) -> tuple[dict[str, torch.Tensor], Optional[dict[str, Any]]]:
            if prep is None or self._delta is None or delta is None:
                tensors, man = state, None
            else:
                tensors, man = self._delta.message(prep, base, delta.get("mode", "auto"))
            sent["sent"] += full if man is None else man["sent_bytes"]
            sent["full"] += full
            sent["delta_ways"] += int(man is not None and man["base"] is not None)
            return tensors, man

        if group:
            if self._sender is None:
                self._sender = WeightSender(self.bind)
            tensors, man = message(None if delta is None else delta.get("group"))
            reply["broadcast"] = self._sender.publish(tensors, group, version)
            if man is not None:
                reply["broadcast"]["delta"] = man
        if to_shm:
            tensors, man = message(None if delta is None else delta.get("shm"))
            reply["handle"] = self._pool(state).put_tensors(tensors)
            reply["shm_delta"] = man
        if prep is not None and self._delta is not None:
            self._delta.commit(prep)
        reply["weight_bytes"] = sent
        return reply

    def _pool(self, state: dict[str, torch.Tensor]) -> shm.ShmPool:
        """Pre-faulted shared memory for published weights: a fresh segment costs ~3x a memcpy
        (page faults and zeroing), on the critical path of every weight-update round."""
        if self._wpool is None:
            nbytes = sum(t.numel() * t.element_size() for t in state.values()) + (1 << 20)
            self._wpool = shm.ShmPool(self.segment_prefix, max_bytes=3 * nbytes, max_segments=2)
            self._wpool.reserve(nbytes, 2)
        return self._wpool

    def close(self) -> None:
        """Free the pool's segments and end the broadcast group (a send in flight is aborted)."""
        if self._wpool is not None:
            self._wpool.close()
        if self._sender is not None:
            self._sender.close()
