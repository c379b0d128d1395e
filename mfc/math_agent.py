"""The default agent of asynchronous PPO: one prompt, a group of sampled answers, a rule reward.

Registered as ``math``. For each data row it asks for ``n_samples`` completions of the
prompt in one call (the controller spreads them over the servers and resumes them
across weight updates), scores every answer with a registered reward (off the event
loop, in the reward process pool) and returns one trajectory per answer; the group
arrives at the trainer together, so GRPO normalises within it.

The sampling fields are the ``ppo.*`` keys of the same names
(``PPOHyperConfig.sampling_args``). Top-p / top-k / min-p sample from a truncation of
the policy the trainer recomputes, so behaviour and trained policies differ on the cut
tokens (the gen server's ``logprob_mode`` reports what it can; the loss is unchanged).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from realflow.api.agent import Agent, AgentContext, register_agent
from realflow.api.generation import SamplingParams
from realflow.api.reward import REWARD_FUNCTIONS
from realflow.api.rollout import Trajectory


@register_agent("math")
@dataclass
class MathAgent(Agent):
    n_samples: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0  # (0, 1], 1 = off
    top_k: int = -1  # -1 = off
    min_p: float = 0.0  # [0, 1], 0 = off
    stop: list[str] = field(default_factory=list)  # stop strings (kept in the response)
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's eos
    reward: str = "arithmetic"
    reward_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.n_samples < 1:
            raise ValueError(f"math agent: n_samples must be >= 1, got {self.n_samples}")
        REWARD_FUNCTIONS.get(self.reward)  # an unknown reward fails when the agent is built, with near misses
        sp = SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                            stop=self.stop, stop_token_ids=self.stop_token_ids).validate()  # fails here, not per row
        self.stop, self.stop_token_ids = sp.stop, sp.stop_token_ids  # a single string -> [string]

    async def run(self, row: dict[str, Any], ctx: AgentContext) -> list[Trajectory]:
        eos = ctx.tokenizer.eos_token_id
        eos_ids = [eos] if eos is not None else []
        params = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "top_k": self.top_k, "min_p": self.min_p, "stop": list(self.stop), "seed": ctx.seed,
                  "stop_token_ids": eos_ids + [t for t in self.stop_token_ids if t not in eos_ids],
                  # behaviour log-probs of the distribution sampled from (tempered) unless T = 1
                  "logprob_mode": "raw" if self.temperature == 1.0 else "sampling"}
        images = {"image_data": row["image_data"]} if row.get("image_data") else {}  # a VL data set's row
        completions = await ctx.generate(row["prompt_ids"], params, n=self.n_samples, **images)
        samples = [{"id": f"{row['id']}/{i}", "response": ctx.tokenizer.decode(c.output_ids, skip_special_tokens=True),
                    "answer": row.get("answer"), "truncated": c.truncated} for i, c in enumerate(completions)]
        rewards = await ctx.score(self.reward, samples, self.reward_args)
        return [c.trajectory(r) for c, r in zip(completions, rewards)]
