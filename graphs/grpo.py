"""GRPO: the PPO-family graph without a critic (see :mod:`graphs.ppo` for the keys).

Advantages come from the group of ``n_samples`` responses to each prompt, so the
graph has no critic MFCs; with ``use_ref=False`` (no KL penalty) it has no
reference model either.
"""
from __future__ import annotations

from graphs.ppo import PPOGraphConfig, build_ppo_family
from realflow.api.dfg import register_graph
from realflow.api.mfc import MFCDef


@register_graph("grpo")
def build_grpo_graph(cfg: PPOGraphConfig) -> list[MFCDef]:
    """Critic-free PPO: group-normalised advantages over ``n_samples`` responses per prompt."""
    if cfg.use_critic:
        raise ValueError("the 'grpo' graph is critic-free (use_critic=False)")
    if cfg.n_samples < 2:
        raise ValueError(f"GRPO needs n_samples >= 2 responses per prompt to normalise within a group, "
                         f"got {cfg.n_samples}")
    return build_ppo_family(cfg)
