"""Agents as plain async functions that talk to the policy through the OpenAI API.

A user module (loaded with ``--import``) defines::

    from realflow.api.agent_function import openai_client, register_agent_function

    @register_agent_function("my_agent")
    async def run_agent_return_reward(data: dict) -> float:
        client = openai_client(data)  # or AsyncOpenAI(base_url=data["base_url"], api_key=data["api_key"])
        r = await client.chat.completions.create(model=data["model"], messages=[...])
        return score(r.choices[0].message.content, data["answer"])

and runs with ``rollout.agent=my_agent``. The function knows nothing of the trainer:
``data`` is the data row (``id``, ``prompt`` text, ``prompt_ids``, ``answer`` and the
row's other fields) plus the session's ``base_url``, ``api_key`` and ``model``. Every
completion it asks for is recorded by the proxy with exact token ids, log-probs and
weight versions; the returned float (or ``None``) is the session's reward, and
:func:`set_reward` sets rewards on single completions. ``n_samples`` sessions run per
data row, concurrently; all their samples form the row's group (GRPO normalises in it).

Agent arguments (``rollout.agent_args``): ``n_samples``, ``export``
(``completion`` | ``conversation``, see :mod:`realflow.api.agent_session`),
``turn_discount``, and the proxy's ``model_name``, ``max_tokens`` (default and cap of a
completion's length) and ``chat_template`` (a Jinja template; default: the tokenizer's,
else a plain one).
"""
from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

from realflow.api.agent import Agent, AgentContext, agent_registry
from realflow.api.agent_session import ExportConfig, session_trajectories
from realflow.api.rollout import RolloutError, Trajectory

__all__ = ["register_agent_function", "FunctionAgent", "set_reward", "AgentFunction", "openai_client"]

AgentFunction = Callable[[dict], Awaitable[Optional[float]]]
_PROXY_KEYS = ("model_name", "max_tokens", "chat_template", "max_n", "max_completions_per_session")


@dataclass
class FunctionAgent(Agent):
    """Runs a registered agent function in proxy sessions and exports what they recorded."""

    fn: AgentFunction
    name: str
    n_samples: int = 1
    export: str = "completion"
    turn_discount: float = 1.0
    proxy_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.n_samples, int) or self.n_samples < 1:
            raise ValueError(f"agent {self.name!r}: n_samples must be an integer >= 1, got {self.n_samples!r}")
        try:
            self.export_cfg = ExportConfig(self.export, self.turn_discount)
        except ValueError as e:
            raise ValueError(f"agent {self.name!r}: {e}") from None

    async def _one(self, row: dict[str, Any], ctx: AgentContext, i: int) -> list[Trajectory]:
        session = await ctx.open_session(seed=ctx.seed + 7919 * i)
        try:
            data = dict(row, base_url=session.base_url, api_key=session.key, model=session.model, sample=i)
            reward = await self.fn(data)
        finally:
            records = ctx.close_session(session.key)
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
            raise RolloutError(f"agent {self.name!r} returned {reward!r}; expected a float reward or None")
        return session_trajectories(records, None if reward is None else float(reward), self.export_cfg)

    async def run(self, row: dict[str, Any], ctx: AgentContext) -> list[Trajectory]:
        if "prompt" not in row and "prompt_ids" in row:
            row = dict(row, prompt=ctx.tokenizer.decode(row["prompt_ids"], skip_special_tokens=True))
        groups = await asyncio.gather(*(self._one(row, ctx, i) for i in range(self.n_samples)))
        trajs = [t for g in groups for t in g]
        if not trajs:
            raise RolloutError(f"agent {self.name!r}: no session of row {row.get('id')} generated anything")
        return trajs


def register_agent_function(name: str, fn: Optional[AgentFunction] = None) -> Any:
    """Register ``async def f(data) -> float | None`` as agent ``name`` (decorator or direct call)."""

    def reg(f: AgentFunction) -> AgentFunction:
        if not inspect.iscoroutinefunction(f):
            raise TypeError(f"agent {name!r}: {getattr(f, '__name__', f)!r} must be an async function "
                            f"(async def run_agent_return_reward(data) -> float)")

        def factory(**args: Any) -> FunctionAgent:
            proxy = {k: args.pop(k) for k in _PROXY_KEYS if k in args}
            return FunctionAgent(fn=f, name=name, proxy_options=proxy, **args)

        agent_registry.register(name)(factory)
        return f

    return reg if fn is None else reg(fn)


_shared: dict[str, Any] = {}


def openai_client(data: dict, **options: Any) -> Any:
    """An ``openai.AsyncOpenAI`` bound to this session (its ``base_url`` and key).

    Why not ``AsyncOpenAI(...)`` per session: building a client costs ~50 ms of CPU (an SSL
    context, a connection pool); a worker running hundreds of sessions spends seconds of its
    event loop on that alone, and agents start timing out. These clients share one client's
    connection pool (``with_options``), so a session's client costs microseconds. Do not
    close it; ``options`` go to ``with_options`` (``timeout=``, ...).
    """
    import openai

    base = _shared.get("client")
    if base is None:
        base = _shared["client"] = openai.AsyncOpenAI(base_url=data["base_url"], api_key=data["api_key"],
                                                      max_retries=0)
    return base.with_options(base_url=data["base_url"], api_key=data["api_key"], **options)


async def set_reward(data: dict, completion_id: str, reward: float, choice: Optional[int] = None,
                     timeout_s: float = 30.0) -> None:
    """Set the reward of one completion (``response.id``) of this session, through the proxy."""
    import aiohttp

    body: dict[str, Any] = {"completion_id": completion_id, "reward": float(reward)}
    if choice is not None:
        body["choice"] = int(choice)
    async with aiohttp.ClientSession() as s:
        async with s.post(data["base_url"] + "/rl/reward", json=body,
                          headers={"Authorization": f"Bearer {data['api_key']}"},
                          timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status >= 400:
                raise RuntimeError(f"set_reward({completion_id!r}): proxy answered {resp.status}: "
                                   f"{await resp.text()}")
