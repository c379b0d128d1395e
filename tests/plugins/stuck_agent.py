"""A user agent function for the async tests (``--import stuck_agent``): the multi-turn math
agent, except that on one row in ``STUCK_EVERY`` it never returns; the rollout worker must
time it out (``rollout.agent_timeout_s``), count it and go on."""
from __future__ import annotations

import asyncio
import zlib

from examples.agents.math_retry import run_agent_return_reward as math_retry
from realflow.api.agent_function import register_agent_function

STUCK_EVERY = 6


@register_agent_function("stuck_sometimes")
async def run_agent_return_reward(data: dict) -> float:
    if zlib.crc32(data["id"].encode()) % STUCK_EVERY == 0:
        await asyncio.Event().wait()  # an agent that never answers
    return await math_retry(data)
