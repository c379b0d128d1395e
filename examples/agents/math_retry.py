"""A multi-turn math agent: it answers, hears "wrong, try again" and answers again.

Run it (the CPU default: the arithmetic SFT start, then 60 steps of asynchronous GRPO on
one-digit problems, where the start is right about half the time)::

    python -m realflow.apps.main_async_ppo experiment=agent-math-retry --import examples.agents.math_retry

The agent is ordinary OpenAI-client code; realflow records every token it is sent
back and trains on the whole conversation (``export=conversation``): both answers are
trained, the feedback turn is in the sequence but masked. A first-try answer earns 1,
a second-try answer ``retry_credit``; so the policy learns to be right the first time.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from experiments.async_ppo_math import AsyncGRPOMathConfig, AsyncRolloutConfig
from experiments.ppo_math import PPOHyperConfig, RLDataConfig
from realflow.api.agent_function import openai_client, register_agent_function
from realflow.api.experiment import OptimizerConfig, register_experiment

FEEDBACK = "wrong, try again: "
MAX_TURNS = 2
RETRY_CREDIT = 0.5  # reward of an answer right on the second try
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
class MathRetryConfig(AsyncGRPOMathConfig):
    """Asynchronous GRPO of the multi-turn ``math_retry`` agent on arithmetic (a user package)."""

    dataset: RLDataConfig = field(default_factory=lambda: RLDataConfig(task="arithmetic", difficulty=1,
                                                                       n_train=8000, n_test=64))
    ppo: PPOHyperConfig = field(default_factory=lambda: PPOHyperConfig(estimator="grpo", n_samples=4,
                                                                       max_new_tokens=16))
    rollout: AsyncRolloutConfig = field(default_factory=lambda: AsyncRolloutConfig(
        agent="math_retry", agent_args={"n_samples": 4, "export": "conversation", "max_tokens": 16}))
    batch_size: int = field(default=16, metadata={"help": "rollouts (prompts, each a group) per train step"})
    max_train_steps: int = field(default=60, metadata={"help": "train steps"})
    actor_optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(
        lr=1e-4, weight_decay=0.0, warmup_steps_proportion=0.0, lr_scheduler_type="constant"))

    _name = "agent-math-retry"
