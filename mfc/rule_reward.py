"""Rule-based reward MFC: decode each response and score it with a registered reward function.

Needs no model (its role uses the "none" backend): only the tokenizer. A reward function
that raises for a sample never fails the batch (see :func:`mfc.reward.compute_rewards`);
the sample gets the configured fallback reward and the error is logged once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from mfc.reward import RewardConfig, RewardInput, compute_rewards
from mfc.rl_batch import INPUT_IDS, NO_EOS, PROMPT_MASK, REWARDS
from realflow.api.batch import MicroBatchSpec, SequenceBatch
from realflow.api.interface import Model, ModelInterface, register_interface


@register_interface("rule_reward")
@dataclass
class RuleRewardInterface(ModelInterface):
    reward: str = "arithmetic"  # a name in mfc.reward.REWARD_FUNCTIONS
    reward_args: dict[str, Any] = field(default_factory=dict)
    fallback_reward: float = 0.0

    def inference(self, model: Model, batch: SequenceBatch, mb_spec: MicroBatchSpec) -> Optional[SequenceBatch]:
        tok = model.tokenizer
        cfg = RewardConfig(name=self.reward, args=dict(self.reward_args), fallback_reward=self.fallback_reward)
        samples, groups = [], []
        for i, sid in enumerate(batch.ids):
            seqs = batch.sequences(INPUT_IDS, i)
            masks = batch.sequences(PROMPT_MASK, i)
            trunc = batch.sequences(NO_EOS, i) if NO_EOS in batch.data else [None] * len(seqs)
            answer = batch.metadata.get("answer", [None] * len(batch))[i]
            for j, (ids, pm, tr) in enumerate(zip(seqs, masks, trunc)):
                resp = ids[~pm.bool()].tolist()
                samples.append(RewardInput(id=f"{sid}/{j}", response=tok.decode(resp, skip_special_tokens=True),
                                           answer=None if answer is None else str(answer),
                                           prompt=tok.decode(ids[pm.bool()].tolist(), skip_special_tokens=True),
                                           truncated=bool(tr is not None and float(tr[0]) > 0)))
            groups.append(len(seqs))
        res = compute_rewards(samples, cfg)
        values = torch.tensor(res.rewards, dtype=torch.float32)
        per_sample, k = [], 0
        for n in groups:
            per_sample.append([values[k + j:k + j + 1] for j in range(n)])
            k += n
        return SequenceBatch.from_samples(batch.ids, {REWARDS: per_sample})
