"""Rejection-sampling fine-tuning: the negative log-likelihood of the responses whose reward
reached ``min_reward``, nothing else (the rejected are dropped, not pushed down).

Each step keeps, per prompt, at most ``max_kept_per_prompt`` of its rewarded samples (the
first ones), so one easy prompt does not dominate a step. A step where no data-parallel
rank kept anything makes no update (reported as ``kept=0``). Stats: ``kept`` (fraction of
samples trained on), ``reward`` (mean over all samples), the NLL per kept token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mfc.packed import next_token_targets
from mfc.rl_batch import action_mask
from realflow.api.batch import MicroBatchSpec, SequenceBatch
from realflow.api.interface import Model, ModelInterface, register_interface

KEY, MASK, REWARDS = "packed_input_ids", "prompt_mask", "rewards"


def _nll(out: Any, extra: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    logp = out.logprobs(extra["targets"])
    return -(logp * extra["mask"]).sum(), {"n_loss_tokens": float(extra["mask"].sum())}


@register_interface("rft")
@dataclass
class RFTInterface(ModelInterface):
    min_reward: float = 1.0
    max_kept_per_prompt: int = 1_000_000

    def _kept(self, batch: SequenceBatch) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
        """(sequences, prompt masks, all rewards) of this rank's batch; the first two only kept ones."""
        seqs, masks, rewards = [], [], []
        for i in range(len(batch)):
            r = [float(x) for x in batch.sequences(REWARDS, i)]
            rewards += r
            kept = [j for j, x in enumerate(r) if x >= self.min_reward][:self.max_kept_per_prompt]
            ids, pm = batch.sequences(KEY, i), batch.sequences(MASK, i)
            seqs += [ids[j] for j in kept]
            masks += [pm[j] for j in kept]
        return seqs, masks, rewards

    def train_step(self, model: Model, batch: SequenceBatch, mb_spec: MicroBatchSpec) -> dict[str, float]:
        eng = model.module
        seqs, masks, rewards = self._kept(batch)
        n_kept, n_all, reward_sum = eng.dp_sum([float(len(seqs)), float(len(rewards)), sum(rewards)])
        stats = {"kept": n_kept / max(n_all, 1.0), "reward": reward_sum / max(n_all, 1.0)}
        if n_kept == 0:
            return stats
        mbs = []
        budget = mb_spec.max_tokens_per_mb or sum(len(s) for s in seqs) or 1
        start = 0
        while start < len(seqs) or not mbs:  # a rank that kept nothing still joins with an empty-weight batch
            end, tokens = start, 0
            while end < len(seqs) and (end == start or tokens + len(seqs[end]) <= budget):
                tokens += len(seqs[end])
                end += 1
            part = seqs[start:end] or seqs[:0]
            if part:
                ids = torch.cat(part)
                lens = [len(s) for s in part]
                targets, _ = next_token_targets(ids, lens)
                mask = action_mask(ids, torch.cat(masks[start:end]), lens).float()
            else:  # one dummy token, weight 0: keeps this rank in the collective schedule
                ids, lens = batch.sequences(KEY, 0)[0][:2], [2]
                targets, _ = next_token_targets(ids, lens)
                mask = torch.zeros(2)
            mbs.append((ids, lens, {"targets": targets, "mask": mask}))
            start = end
            if not part:
                break
        out = eng.train_batch(mbs, _nll, lambda extra: float(extra["mask"].sum()))
        stats.update({"loss": out["loss"], "grad_norm": out["grad_norm"], "lr": out["lr"],
                      "n_loss_tokens": out["n_loss_tokens"]})
        return stats

    def save(self, model: Model, path: str) -> None:
        model.module.save_hf(path, tokenizer_dir=getattr(model.tokenizer, "name_or_path", None))
