"""The default agent of asynchronous PPO: one prompt, a group of sampled answers, a rule reward.

Registered as ``math``. For each data row it asks for ``n_samples`` completions of the
prompt in one call (the controller spreads them over the servers and resumes them
across weight updates), scores every answer with a registered reward (off the event
loop, in the reward process pool) and returns one trajectory per answer; the group
arrives at the trainer together, so GRPO normalises within it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from realflow.api.agent import Agent, AgentContext, register_agent
from realflow.api.reward import REWARD_FUNCTIONS
from realflow.api.rollout import Trajectory


@register_agent("math")
@dataclass
class MathAgent(Agent):
    n_samples: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    reward: str = "arithmetic"
    reward_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.n_samples < 1:
            raise ValueError(f"math agent: n_samples must be >= 1, got {self.n_samples}")
        REWARD_FUNCTIONS.get(self.reward)  # an unknown reward fails when the agent is built, with near misses

    async def run(self, row: dict[str, Any], ctx: AgentContext) -> list[Trajectory]:
        eos = ctx.tokenizer.eos_token_id
        params = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "seed": ctx.seed, "stop_token_ids": [eos] if eos is not None else [],
                  # behaviour log-probs of the distribution sampled from (tempered) unless T = 1
                  "logprob_mode": "raw" if self.temperature == 1.0 else "sampling"}
        completions = await ctx.generate(row["prompt_ids"], params, n=self.n_samples)
        samples = [{"id": f"{row['id']}/{i}", "response": ctx.tokenizer.decode(c.output_ids, skip_special_tokens=True),
                    "answer": row.get("answer"), "truncated": c.truncated} for i, c in enumerate(completions)]
        rewards = await ctx.score(self.reward, samples, self.reward_args)
        return [c.trajectory(r) for c, r in zip(completions, rewards)]
