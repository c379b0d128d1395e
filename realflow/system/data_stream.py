"""Epoch-wise, seeded iteration over one worker's shard of a data set."""
from __future__ import annotations

import random
from typing import Optional

from realflow.api.batch import SequenceBatch


class ShardStream:
    """Hands out samples of a shard in a seeded order that changes every epoch.

    ``position`` and ``epoch`` are the whole state, so a recover point can restore
    the stream exactly.
    """

    def __init__(self, samples: list[SequenceBatch], seed: int):
        if not samples:
            raise ValueError("this worker's data shard is empty; use fewer workers or more data")
        self.samples = samples
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._shuffle(0)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.samples)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self, n: int) -> tuple[Optional[SequenceBatch], bool]:
        """Up to ``n`` samples; the flag says this call reached the end of the epoch."""
        if self.position >= len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = self._shuffle(self.epoch)
        take = self._order[self.position : self.position + n]
        self.position += len(take)
        done = self.position >= len(self._order)
        if not take:
            return None, done
        return SequenceBatch.gather([self.samples[i] for i in take]), done

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state(self, state: dict) -> None:
        """Continue where :meth:`state` was taken (same data, same seed)."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._shuffle(self.epoch)
