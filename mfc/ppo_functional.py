"""PPO training-loop helpers, and one import point for the PPO-family functions.

An actor/critic interface needs: token rewards (:mod:`mfc.kl`), advantages
(:mod:`mfc.advantages`), losses (:mod:`mfc.losses`), plus the two helpers defined
here: masking of truncated responses and the mini-batch/epoch schedule.

Mini-batches split by SAMPLES (a sample keeps its whole group of responses, so
group statistics never straddle two updates) after a seeded shuffle that depends
on (seed, step, epoch) only: every data-parallel rank cuts its shard the same
way without talking, and a resumed run repeats the same schedule.
"""
from __future__ import annotations

import random
from typing import Iterator, Sequence

import torch

from mfc.advantages import (as_seqlens, discounted_returns, gae, grpo_advantages, normalize,
                            reinforce_pp_advantages, rloo_advantages, segment_ids, seq_to_token,
                            segment_discounted_cumsum, segment_sum, token_group_ids)
from mfc.kl import (AdaptiveKLController, FixedKLController, KLControlConfig, kl_estimate,
                    make_kl_controller, shape_rewards)
from mfc.losses import (AGG_MODES, aggregate, aggregation_weight, entropy_from_logits, mean_stats, ppo_actor_loss,
                        token_logprobs, value_loss)
from mfc.ppo_config import LossConfig
from realflow.api.batch import SequenceBatch

__all__ = [
    "mask_truncated", "minibatch_indices", "split_minibatches", "ppo_minibatches",
    # re-exported
    "as_seqlens", "discounted_returns", "gae", "grpo_advantages", "normalize", "reinforce_pp_advantages",
    "rloo_advantages", "segment_ids", "seq_to_token", "segment_discounted_cumsum", "segment_sum", "token_group_ids",
    "AdaptiveKLController", "FixedKLController", "KLControlConfig", "kl_estimate", "make_kl_controller",
    "shape_rewards", "AGG_MODES", "LossConfig", "aggregate", "aggregation_weight",
    "entropy_from_logits", "mean_stats", "ppo_actor_loss", "token_logprobs", "value_loss",
]


def mask_truncated(loss_mask: torch.Tensor, seqlens: Sequence[int] | torch.Tensor,
                   truncated: torch.Tensor) -> torch.Tensor:
    """``loss_mask`` with every token of truncated sequences (cut by ``max_new_tokens``,
    no EOS) set to False: their outcome reward judges an unfinished answer."""
    lens = as_seqlens(seqlens, loss_mask.shape[0])
    if truncated.shape != (len(lens),):
        raise ValueError(f"mask_truncated: need one flag per sequence ({len(lens)}), "
                         f"got shape {tuple(truncated.shape)}")
    keep = seq_to_token(~truncated.bool().to(loss_mask.device), lens)
    return loss_mask.bool() & keep


def minibatch_indices(n_samples: int, n_minibatches: int, seed: int = 0, step: int = 0,
                      epoch: int = 0, shuffle: bool = True) -> list[list[int]]:
    """Sample positions of each mini-batch: a (seed, step, epoch)-seeded permutation cut
    into ``n_minibatches`` parts whose sizes differ by at most one. Positions inside a
    part are sorted (the order of samples within one update does not matter)."""
    if isinstance(n_minibatches, bool) or not isinstance(n_minibatches, int) or n_minibatches < 1:
        raise ValueError(f"n_minibatches must be an integer >= 1, got {n_minibatches!r}")
    if n_minibatches > n_samples:
        raise ValueError(f"cannot split {n_samples} samples into {n_minibatches} PPO mini-batches")
    order = list(range(n_samples))
    if shuffle:
        random.Random(f"realflow-ppo-mb:{seed}:{step}:{epoch}").shuffle(order)
    base, extra = divmod(n_samples, n_minibatches)
    parts, start = [], 0
    for i in range(n_minibatches):
        size = base + (1 if i < extra else 0)
        parts.append(sorted(order[start:start + size]))
        start += size
    return parts


def split_minibatches(batch: SequenceBatch, n_minibatches: int, seed: int = 0, step: int = 0,
                      epoch: int = 0, shuffle: bool = True) -> list[SequenceBatch]:
    """``batch`` cut into ``n_minibatches`` sample-disjoint batches (see module docstring)."""
    return [batch.select_ids([batch.ids[i] for i in part])
            for part in minibatch_indices(len(batch), n_minibatches, seed, step, epoch, shuffle)]


def ppo_minibatches(batch: SequenceBatch, ppo_epochs: int, n_minibatches: int, seed: int = 0,
                    step: int = 0, shuffle: bool = True) -> Iterator[tuple[int, int, SequenceBatch]]:
    """``(epoch, index, mini-batch)`` for ``ppo_epochs`` passes over ``batch``, reshuffled per epoch."""
    if isinstance(ppo_epochs, bool) or not isinstance(ppo_epochs, int) or ppo_epochs < 1:
        raise ValueError(f"ppo_epochs must be an integer >= 1, got {ppo_epochs!r}")
    for epoch in range(ppo_epochs):
        for i, mb in enumerate(split_minibatches(batch, n_minibatches, seed, step, epoch, shuffle)):
            yield epoch, i, mb
