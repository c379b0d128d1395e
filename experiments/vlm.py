"""Vision-language RL: GRPO of a small Qwen2.5-VL that counts shapes in images (``experiment=vlm-grpo``).

Why this default: a VLM run on CPU must show that the policy reads its image and that RL
improves it, with a rule reward and minutes of compute. The ``shapes_count`` task
(:mod:`experiments.tasks.shapes_count`) asks how many shapes an 84x84 image shows; the answer
is in the pixels only (every question is the same words). The start is a tiny Qwen2.5-VL (a
2-block vision tower and a 3-layer language model) trained from scratch by SFT on *careless*
demonstrations (``dataset.slip_rate=0.3``: 30% end in a near-miss count, see
:mod:`experiments.tasks.careless`), so at temperature 1 it slips about that often where its
greedy count is right -- the samples of a group disagree, and GRPO removes the slips. Held-out
pass@1 (``sampled_accuracy``) rises towards greedy accuracy; docs/vision.md has the numbers.

Everything else is the synchronous GRPO experiment's (``grpo-math``): any Qwen2.5-VL / Qwen2-VL
checkpoint (``model.path``) and image data set (``dataset.train_path``, rows with ``images``)
run the same way, and ``main_async_ppo`` takes a VL actor too.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from experiments.ppo_hyper import PPOHyperConfig
from experiments.ppo_math import GRPOMathConfig, RLDataConfig
from realflow.api.experiment import OptimizerConfig, register_experiment


@register_experiment("vlm-grpo")
@dataclass
class VLMGRPOConfig(GRPOMathConfig):
    """GRPO of a vision-language model on image prompts (default: counting shapes, see module docstring)."""

    dataset: RLDataConfig = field(default_factory=lambda: RLDataConfig(task="shapes_count", n_train=4000,
                                                                       n_test=200))
    ppo: PPOHyperConfig = field(default_factory=lambda: PPOHyperConfig(estimator="grpo", n_samples=8,
                                                                       max_new_tokens=8))
    actor_optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(
        lr=1e-4, weight_decay=0.0, warmup_steps_proportion=0.0, lr_scheduler_type="constant"))
    batch_size: int = field(default=32, metadata={"help": "prompts per step (global)"})
    max_train_steps: int = field(default=60, metadata={"help": "stop after this many steps"})


VLMGRPOConfig._name = "vlm-grpo"
