"""Agents: user code that turns one data row into scored trajectories (asynchronous PPO).

An agent is registered by name (``@register_agent("my_agent")`` in any module given to
``--import``) and selected by ``agent=my_agent``. For every admitted data row a rollout
worker calls ``await agent.run(row, ctx)``; the agent may send any number of
generation requests (group sampling, several turns, tool calls) through
``ctx.generate`` and returns its :class:`~realflow.api.rollout.Trajectory` list, one
per sequence to train on. Rewards run off the event loop, in a process pool with a
per-call timeout, through ``ctx.score``: a slow or hanging reward never blocks other
rollouts.

Why this shape: the rollout worker owns admission, routing, interruption and
transport; the agent owns only what is specific to the task. An agent that raises is
logged and counted by the worker, never fatal to the run.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

from realflow.api.registry import Registry
from realflow.api.rollout import Trajectory

__all__ = ["Agent", "AgentContext", "Completion", "agent_registry", "register_agent", "make_agent",
           "RewardTimeout"]


class RewardTimeout(TimeoutError):
    """A reward call did not finish within the configured time; names the reward."""


@dataclass
class Completion:
    """One generated continuation, as the rollout controller returns it.

    Interrupted and resumed requests come back whole: ``output_ids`` holds every token
    once, with the behaviour log-prob and the weight version of each.
    """

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # stop | length | abort
    text: Optional[str] = None
    info: dict[str, Any] = field(default_factory=dict)
    #: MoE policy: numpy ``[len(prompt_ids) + len(output_ids) - 1, layers, topk]`` expert ids
    #: (routing replay, :mod:`realflow.api.routing`); None for dense models
    routed_experts: Any = None
    #: vision-language policy: the prompt's images (:class:`realflow.api.images.ImageInputs`, their
    #: placeholders expanded in ``prompt_ids``); None for text prompts
    images: Any = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    def trajectory(self, reward: float) -> Trajectory:
        return Trajectory.single_turn(self.prompt_ids, self.output_ids, self.logprobs, self.versions,
                                      reward, truncated=self.truncated, routed_experts=self.routed_experts,
                                      images=self.images)


class AgentContext(Protocol):
    """What a rollout worker gives an agent for one rollout."""

    tokenizer: Any
    seed: int  # reproducible per (run seed, row)

    async def generate(self, input_ids: Sequence[int], sampling_params: dict[str, Any],
                       n: int = 1, image_data: Optional[Sequence[Any]] = None) -> list[Completion]:
        """``n`` completions of ``input_ids`` (SGLang ``sampling_params`` names). ``image_data``
        (vision-language policies): the prompt's images in order (encoded bytes, base64 or data
        URLs), their placeholders in ``input_ids`` one per image or expanded; the completions'
        ``prompt_ids`` are expanded and their ``images`` carry what the trainer needs."""
        ...

    async def score(self, reward: str, samples: Sequence[dict[str, Any]],
                    args: Optional[dict[str, Any]] = None) -> list[float]:
        """Registered reward ``reward`` on each sample (a dict of the reward's input
        fields), in the reward process pool; raises :class:`RewardTimeout` on timeout."""
        ...

    async def open_session(self, seed: int) -> Any:
        """A session of the worker's OpenAI-compatible proxy (``.base_url``, ``.key``, ``.model``),
        see :mod:`realflow.api.agent_function`."""
        ...

    def close_session(self, key: str) -> list[Any]:
        """End a session; its :class:`~realflow.api.agent_session.RecordedCompletion` list."""
        ...


class Agent(abc.ABC):
    """Base class of registered agents; constructed once per rollout worker with the config's args."""

    @abc.abstractmethod
    async def run(self, row: dict[str, Any], ctx: AgentContext) -> list[Trajectory]:
        """Play one episode on ``row`` (its ``prompt_ids`` are tokenized); return trajectories."""


agent_registry: Registry[Callable[..., Agent]] = Registry("agent")


def register_agent(name: str) -> Callable[[Callable[..., Agent]], Callable[..., Agent]]:
    """Class decorator: ``@register_agent("math") class MathAgent(Agent): ...``."""
    return agent_registry.register(name)


def make_agent(name: str, args: Optional[dict[str, Any]] = None) -> Agent:
    """Instantiate agent ``name``; unknown names and bad args fail naming the agent."""
    cls = agent_registry.get(name)
    try:
        return cls(**dict(args or {}))
    except TypeError as e:
        raise ValueError(f"agent {name!r}: bad agent_args {args!r}: {e}") from None
