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

import random
import re
from dataclasses import dataclass, field
from typing import Any

from examples.agents.own_start import OwnStartAgentConfig
from experiments.async_ppo_math import AsyncRolloutConfig
from experiments.ppo_math import PPOHyperConfig, RLDataConfig
from experiments.tasks.arithmetic import sample_problem, solution_text
from realflow.api.agent_function import openai_client, register_agent_function
from realflow.api.experiment import OptimizerConfig, register_experiment

FEEDBACK = "wrong, try again: "
MAX_TURNS = 2
RETRY_CREDIT = 0.5  # reward of an answer right on the second try
DATA_VERSION = 1
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


def near_miss(rng: random.Random, result: int) -> int:
    """A plausible wrong answer: off by one or two in the last digit, or by ten."""
    wrong = result + rng.choice((-10, -2, -1, 1, 2, 10))
    return wrong if wrong >= 0 and wrong != result else result + 1


def make_rows(n: int, seed: int, difficulty: int, slip_rate: float) -> tuple[list[dict], list[dict]]:
    """(SFT demonstrations, RL rows) for ``n`` arithmetic problems.

    A demonstration is the conversation the agent will hold, in the plain chat layout
    (``PLAIN_CHAT_TEMPLATE``: turns back to back, an answer ends with ``</s>``)."""
    rng = random.Random(f"math-retry:{seed}")
    sft, rl = [], []
    for i in range(n):
        p = sample_problem(rng, difficulty)
        answer, good = str(p.result), solution_text(str(p.result))
        rl.append({"id": f"retry-{seed}-{i}", "prompt": p.prompt, "answer": answer})
        if rng.random() < slip_rate:
            wrong = str(near_miss(rng, p.result))
            bad = solution_text(wrong)
            sft.append({"prompt": p.prompt, "solution": bad, "answer": wrong})
            sft.append({"prompt": f"{p.prompt}{bad}</s>{FEEDBACK}{p.prompt}", "solution": good, "answer": answer})
        else:
            sft.append({"prompt": p.prompt, "solution": good, "answer": answer})
    return sft, rl


@register_experiment("agent-math-retry")
@dataclass
class MathRetryConfig(OwnStartAgentConfig):
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
        return make_rows(n, seed, self._difficulty(), self.slip_rate)
