"""A multi-turn math agent: it answers, hears "wrong, try again" and answers again.

Run it (CPU: a small SFT start on generated demonstrations, then asynchronous GRPO)::

    python -m realflow.apps.main_async_ppo experiment=agent-math-retry --import examples.agents.math_retry

The agent is ordinary OpenAI-client code; realflow records every token it is sent
back and trains on the whole conversation (``export=conversation``): both answers are
trained, the feedback turn is in the sequence but masked. A first-try answer earns 1,
a second-try answer ``RETRY_CREDIT``; so the policy learns to be right the first time.

The SFT start imitates a careless solver: a ``slip_rate`` share of its first answers
are near misses, each followed in the demonstrations by the feedback and a correct
second answer. It so knows how to recover, and samples at temperature 1 disagree
within a group -- which is what GRPO learns from (a start that always gives its greedy
answer leaves every group's rewards equal). RL removes the slips.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from examples.careless import careless_rows
from examples.own_start import OwnStartMixin
from experiments.async_ppo_math import AsyncGRPOMathConfig, AsyncRolloutConfig
from experiments.ppo_math import PPOHyperConfig, RLDataConfig
from realflow.api.agent_function import openai_client, register_agent_function
from realflow.api.experiment import OptimizerConfig, register_experiment

FEEDBACK = "wrong, try again: "
MAX_TURNS = 2
RETRY_CREDIT = 0.5  # reward of an answer right on the second try
DATA_VERSION = 2
_ANSWER = re.compile(r"####\s*(-?\d+)")


def final_answer(text: str | None) -> str | None:
    m = _ANSWER.search(text or "")
    return m.group(1) if m else None


@register_agent_function("math_retry")
async def run_agent_return_reward(data: dict[str, Any]) -> float:
    messages = [{"role": "user", "content": data["prompt"]}]
    client = openai_client(data)  # an AsyncOpenAI for this session (one connection pool per process)
    for turn in range(MAX_TURNS):
        reply = await client.chat.completions.create(model=data["model"], messages=messages, max_tokens=16,
                                                     temperature=1.0)
        content = reply.choices[0].message.content
        if final_answer(content) == str(data["answer"]).strip():
            return RETRY_CREDIT ** turn  # 1 on the first try
        messages += [{"role": "assistant", "content": content},
                     {"role": "user", "content": FEEDBACK + data["prompt"]}]
    return 0.0


@register_experiment("agent-math-retry")
@dataclass
class MathRetryConfig(OwnStartMixin, AsyncGRPOMathConfig):
    """Asynchronous GRPO of the multi-turn ``math_retry`` agent on arithmetic (a user package)."""

    dataset: RLDataConfig = field(default_factory=lambda: RLDataConfig(task="arithmetic", difficulty=2,
                                                                       n_train=8000, n_test=64))
    ppo: PPOHyperConfig = field(default_factory=lambda: PPOHyperConfig(estimator="grpo", n_samples=4,
                                                                       max_new_tokens=16))
    rollout: AsyncRolloutConfig = field(default_factory=lambda: AsyncRolloutConfig(
        agent="math_retry", agent_args={"n_samples": 4, "export": "conversation", "max_tokens": 16}))
    slip_rate: float = field(default=0.3, metadata={"help": "share of SFT first answers that are near misses"})
    batch_size: int = field(default=16, metadata={"help": "rollouts (prompts, each a group) per train step"})
    max_train_steps: int = field(default=60, metadata={"help": "train steps"})
    actor_optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(
        lr=1e-4, weight_decay=0.0, warmup_steps_proportion=0.0, lr_scheduler_type="constant"))

    _name = "agent-math-retry"
    _start_name = "math-retry"
    _sft_extra = ("eval_max_new_tokens=16",)

    def _data_tag(self) -> str:
        return f"math-retry-v{DATA_VERSION}-d{self._difficulty()}-slip{self.slip_rate:g}"

    def make_rows(self, n: int, seed: int) -> tuple[list[dict], list[dict]]:
        return careless_rows(n, seed, self._difficulty(), self.slip_rate, "math-retry",
                             retry_feedback=FEEDBACK)
