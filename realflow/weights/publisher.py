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

__all__ = ["WeightPublisher"]


class WeightPublisher:
    """Owns the pre-faulted shared-memory pool and the broadcast writer of one model worker.

    ``segment_prefix`` names the run's shared-memory segments; ``bind`` is the address
    the broadcast group's connections use (the worker's host address).
    """

    def __init__(self, segment_prefix: str, bind: str) -> None:
        self.segment_prefix, self.bind = segment_prefix, bind
        self._wpool: Optional[shm.ShmPool] = None
        self._sender: Optional[WeightSender] = None  # broadcasts to servers on other hosts

    def publish(self, state: dict[str, torch.Tensor], version: int, group: Optional[dict[str, Any]],
                to_shm: bool) -> dict[str, Any]:
        """Publish ``state`` as ``version``: broadcast it to ``group`` (a ``GroupSpec`` on the wire,
        from the controller's plan) and/or put it in shared memory (``to_shm``: servers on this host).

        Returns the writer's reply: ``handle`` (the segment, or None), ``host`` and, with a
        group, ``broadcast`` (what the receivers need to join and load it).
        """
        reply: dict[str, Any] = {"handle": None, "host": socket.gethostname()}
        if group:
            if self._sender is None:
                self._sender = WeightSender(self.bind)
            reply["broadcast"] = self._sender.publish(state, group, version)
        if to_shm:
            reply["handle"] = self._pool(state).put_tensors(state)
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
