"""Asynchronous GRPO on a code task: ``python -m realflow.apps.main_async_ppo experiment=async-grpo-code``.

Why a code default: code RL differs from math RL in one place -- the reward runs the
model's program (the ``code-tests`` reward, every test case in the bubblewrap sandbox of
:mod:`realflow.base.sandbox`) -- and that place has its own failure modes (slow, hostile
or crashing programs, sandbox cost per step). This default exercises it end to end on
CPU: the SFT start of task ``code_expr`` (one-line programs ``n=int(input());print(a*n+b)``
from a spec, :mod:`experiments.tasks.code_expr`; trained first if absent), then the
``async-grpo-math`` machinery unchanged -- the ``math`` agent samples ``n_samples``
programs per prompt and scores them in the rollout worker's reward process pool --
with ``reward=code-tests``. Held-out evaluation scores greedy and sampled programs with
the same reward (the task's ``eval_reward``), so ``accuracy`` is the mean fraction of
test cases passed.

Everything else (fields, allocation, staleness bound, weight sync) is ``async-grpo-math``'s;
the defaults below differ where programs differ from worked arithmetic: responses of at
most ~10 tokens; a small held-out set (each held-out response costs ``N_TESTS`` sandboxed
runs); ``reward_args`` with a sandbox wall limit well inside ``rollout.reward_timeout_s``
and the reward's outcome cache (a group repeats programs, and each sandboxed run costs tens
of ms of mostly kernel time: ~25 s per step with 4 tests and no cache on a busy machine,
~3 s with 3 tests and the cache);
lr 1e-4 (5e-4 collapsed the policy) with a KL penalty to the SFT start (``kl_coef=0.1``).

Measured (2 shared CPU cores, fresh file root): the SFT start in 2.4 min (87 s of training),
0.54 held-out greedy test pass rate (formula 100%, examples 4%); then 60 steps in 208 s of
training, 4.4 min in all: training reward 0.466 -> 0.644 (mean of the first vs last 5
steps; 0.495 -> 0.684 over 10), held-out sampled pass@1 0.527 -> 0.648, greedy 0.703 ->
0.656. Without the KL penalty: 0.466 -> 0.616, sampled 0.527 -> 0.582, greedy 0.703 ->
0.625 (greedy loses some ``examples`` answers the SFT start had memorized: the data space
is small, so RL and held-out prompts overlap SFT's). The gain is the demonstrated bugs
going away, not the subtraction (see :mod:`experiments.tasks.code_expr`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from experiments.async_ppo_math import AsyncGRPOMathConfig, AsyncRolloutConfig
from experiments.ppo_math import EVAL_REWARD_HELP, REWARD_ARGS_HELP, PPOHyperConfig, RLDataConfig
from realflow.api.experiment import OptimizerConfig, register_experiment


@register_experiment("async-grpo-code")
@dataclass
class AsyncGRPOCodeConfig(AsyncGRPOMathConfig):
    """Asynchronous GRPO on generated programming tasks, rewarded in the sandbox (see experiments.async_ppo_code)."""

    dataset: RLDataConfig = field(default_factory=lambda: RLDataConfig(task="code_expr", n_test=64))
    ppo: PPOHyperConfig = field(default_factory=lambda: PPOHyperConfig(estimator="grpo", n_samples=8,
                                                                       max_new_tokens=16, kl_coef=0.1))
    rollout: AsyncRolloutConfig = field(default_factory=lambda: AsyncRolloutConfig(reward_timeout_s=30.0))
    actor_optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(
        lr=1e-4, weight_decay=0.0, warmup_steps_proportion=0.0, lr_scheduler_type="constant"))
    reward: str = field(default="code-tests", metadata={"help": "reward function (reward registry)"})
    reward_args: dict[str, Any] = field(default_factory=lambda: {"wall_s": 2.0, "cpu_s": 1, "cache": 4096},
                                        metadata={"help": REWARD_ARGS_HELP})
    eval_reward: str = field(default="", metadata={"help": EVAL_REWARD_HELP})
    batch_size: int = field(default=16, metadata={"help": "rollouts (prompts, each a group) per train step"})
    max_train_steps: Optional[int] = field(default=60, metadata={"help": "train steps"})
    eval_n_samples: int = field(default=4, metadata={
        "help": "held-out samples per prompt at the training temperature for sampled_accuracy (pass@1)"})

    _name = "async-grpo-code"
