"""Which prompts an asynchronous run has handed out, and which of those are not trained yet.

The rollout controller numbers the prompts it hands out (0, 1, 2, ...: the data set in a
seeded order per epoch) and keeps the numbers that are handed out but not yet trained:
running, buffered in a trainer's inbox, or finished but not yet picked. That set is small
(bounded by the staleness limit), and together with the next number it is the whole data
position of the run: a recover point stores both, and a resumed run hands out the
untrained ones again before going on. So no prompt is trained twice and none is lost,
whatever was in flight when the fault hit.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Iterable, Optional


class PromptLedger:
    def __init__(self, next_index: int = 0, redo: Iterable[int] = (), failed: int = 0) -> None:
        self.next_index = int(next_index)
        self.redo = deque(sorted(int(i) for i in redo))  # handed out before a fault, never trained
        self.open: dict[int, Optional[str]] = {}  # handed out, not trained -> its sample id once finished
        self._index_of: dict[str, int] = {}
        self.failed = int(failed)  # rollouts whose agent failed: dropped, never handed out again
        # A rollout worker pushes a trajectory to a trainer before it reports /done, so a fast
        # trainer can report it trained first: such ids wait here for their /done.
        self._trained_before_done: set[str] = set()

    def hand_out(self) -> int:
        index = self.redo.popleft() if self.redo else self._take_next()
        self.open[index] = None
        return index

    def _take_next(self) -> int:
        self.next_index += 1
        return self.next_index - 1

    def finished(self, index: int, sample_id: str, ok: bool) -> None:
        """Rollout ``index`` reached a trainer as ``sample_id`` (``ok``) or failed (dropped for good)."""
        if index not in self.open:
            raise ValueError(f"/done for prompt {index}: it was not handed out (or already finished)")
        if ok and sample_id in self._trained_before_done:
            self._trained_before_done.discard(sample_id)
            del self.open[index]
        elif ok:
            self.open[index] = sample_id
            self._index_of[sample_id] = index
        else:
            del self.open[index]
            self.failed += 1

    def trained(self, sample_ids: Iterable[str]) -> None:
        for sid in sample_ids:
            index = self._index_of.pop(sid, None)
            if index is not None:
                self.open.pop(index, None)
            else:
                self._trained_before_done.add(sid)

    def state(self) -> dict[str, Any]:
        """The data position for a recover point: the next number and the untrained ones.
        Always ``next_index == trained + len(pending) + failed``."""
        return {"next_index": self.next_index, "pending": sorted([*self.open, *self.redo]), "failed": self.failed}
