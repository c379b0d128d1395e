"""The trainer's writer in weight broadcasts to generation servers on other hosts.

A publish (after each train step) hands the new full weights to a background thread
that forms the weight group if needed (the rollout controller has the servers join
it) and broadcasts them; the train step that follows does not wait. The next publish
first waits for that send to finish, so the servers receive every published version
in order and the writer never holds more than one copy in flight.

Membership is the controller's: each publish carries its ``GroupSpec`` (name,
generation, receivers). A new generation (a server died, or a send failed) closes
the old group -- aborting a send still blocked in it -- and forms a new one.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

import torch

from realflow.weights.broadcast import (GroupSpec, TensorMeta, WeightBroadcastError, WeightGroup,
                                            close_store, open_store)

__all__ = ["WeightSender"]

logger = logging.getLogger("realflow.weight_sender")


class WeightSender:
    """One per writer model worker; used from its request thread only."""

    def __init__(self, bind: str) -> None:
        self.bind = bind
        self.spec: Optional[GroupSpec] = None
        self._store: Any = None
        self.group: Optional[WeightGroup] = None
        self._thread: Optional[threading.Thread] = None
        self.last_error: Optional[str] = None
        self.sent_s: list[float] = []

    def publish(self, state: dict[str, torch.Tensor], plan: dict[str, Any], version: int) -> dict[str, Any]:
        """Start broadcasting ``state`` as ``version``; return what the receivers need to join and load it."""
        want = GroupSpec.from_wire(plan)
        fresh = self.spec is None or (want.name, want.generation) != (self.spec.name, self.spec.generation)
        if fresh and self.group is not None:
            self.group.abort()  # a send blocked in the old group ends now
        self._wait_previous(want.timeout_s)
        if fresh:
            self._close()
            want.address = self.bind
            self._store = open_store(want, 0)  # fills want.port; listens on self.bind only
            self.spec = want
        assert self.spec is not None
        # a copy: some exported tensors alias the live parameters, which the next step updates
        spec, tensors = self.spec, [t.detach().clone() for t in state.values()]
        self._thread = threading.Thread(target=self._send, args=(spec, tensors, version),
                                        name=f"weight-send-v{version}", daemon=True)
        self._thread.start()
        return {"group": spec.to_wire(), "meta": TensorMeta.of(state).to_body(), "version": version}

    def _send(self, spec: GroupSpec, tensors: list[torch.Tensor], version: int) -> None:
        t0 = time.perf_counter()
        try:
            if self.group is None:
                self.group = WeightGroup(spec, 0, self.bind, store=self._store)
            self.group.send(tensors)
            self.sent_s.append(time.perf_counter() - t0)
            logger.info("weights v%d broadcast to %s in %.3f s", version, spec.members, self.sent_s[-1])
        except WeightBroadcastError as e:
            self.last_error = f"v{version}: {e}"
            logger.error("weights v%d not delivered: %s", version, e)
            self._drop_group()

    def _wait_previous(self, timeout_s: float) -> None:
        t = self._thread
        if t is None:
            return
        t.join(timeout_s + 5.0)
        if t.is_alive():  # the group's own timeout should have ended it; do not wait forever
            logger.error("the previous weight send is still blocked after %.0f s; abandoning its group", timeout_s)
            self._drop_group()

    def _drop_group(self) -> None:
        """A failed or abandoned group cannot be reused: the next publish forms a new one."""
        g, self.group = self.group, None
        if g is not None:
            g.abort()
        self.spec = None
        close_store(self._store)
        self._store = None

    def _close(self) -> None:
        g, self.group = self.group, None
        if g is not None:
            g.close()
        close_store(self._store)
        self._store = None

    def close(self) -> None:
        if self.group is not None:
            self.group.abort()
        if self._thread is not None:
            self._thread.join(10.0)
        self._close()
