"""A user agent package for the async PPO tests (loaded with ``--import flaky_agent``).

``flaky`` behaves like the math agent, except that on some rows it raises and on some
others it scores with ``sleepy``, a reward that never finishes in time: both must be
logged and counted, never fatal.
"""
from __future__ import annotations

import time
import zlib
from dataclasses import dataclass

from mfc.math_agent import MathAgent
from realflow.api.agent import register_agent
from realflow.api.reward import register_reward


@register_reward("sleepy")
def sleepy_reward(sample, seconds: float = 30.0) -> float:
    time.sleep(seconds)
    return 0.0


@register_agent("flaky")
@dataclass
class FlakyAgent(MathAgent):
    every: int = 5

    async def run(self, row, ctx):
        h = zlib.crc32(row["id"].encode()) % self.every
        if h == 0:
            raise RuntimeError(f"flaky agent refuses row {row['id']}")
        if h == 1:
            await ctx.score("sleepy", [{"id": row["id"], "response": ""}])
        return await super().run(row, ctx)
