"""Direct preference optimisation (Rafailov et al., 2023) on preference pairs.

Per pair, with ``s(y) = sum of log p(response tokens of y)`` under the policy and ``s_ref``
under the frozen reference: the implicit rewards are ``beta * (s(y) - s_ref(y))`` and the
loss is ``-log sigmoid(r(chosen) - r(rejected))``. Only response tokens count
(``prompt_mask`` marks the prompt). The reference's per-token log-probs arrive as
``packed_ref_logprobs`` from the graph's ``ref_inf`` call.

Held-out evaluation needs the reference too, but an evaluation sees only the policy: the
experiment stores the reference's sums in the held-out rows (``ref_logps``, computed once
by ``prepare``), and ``evaluate`` reports preference accuracy (implicit reward of the chosen
above the rejected; ties count half) and the mean implicit reward margin.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from examples.dpo.graph import REF_LOGPROBS
from mfc.packed import next_token_targets
from mfc.rl_batch import action_mask
from realflow.api.batch import MicroBatchSpec, SequenceBatch
from realflow.api.interface import Model, ModelInterface, register_interface

KEY = "packed_input_ids"


def sequence_sums(per_token: torch.Tensor, mask: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
    """Sum of ``per_token`` over ``mask`` within each packed sequence."""
    seq = torch.repeat_interleave(torch.arange(len(seqlens)), torch.tensor(seqlens))
    return torch.zeros(len(seqlens), dtype=per_token.dtype).index_add(0, seq, per_token * mask)


def _right(margin: torch.Tensor) -> float:
    return float((margin > 0).sum() + 0.5 * (margin == 0).sum())


@register_interface("dpo")
@dataclass
class DPOInterface(ModelInterface):
    beta: float = 0.1
    max_tokens_per_mb: int = 4096  # for evaluation

    def train_step(self, model: Model, batch: SequenceBatch, mb_spec: MicroBatchSpec) -> dict[str, float]:
        mbs = []
        for mb in batch.micro_batches(mb_spec):
            ids = mb.data[KEY]
            lens = [n for pair in mb.seqlens[KEY] for n in pair]
            targets, _ = next_token_targets(ids, lens)
            mask = action_mask(ids, mb.data["prompt_mask"], lens).float()
            ref = sequence_sums(mb.data[REF_LOGPROBS].float(), mask, lens)
            mbs.append((ids, lens, {"targets": targets, "mask": mask, "lens": lens, "ref": ref}))
        stats = model.module.train_batch(mbs, self._loss, lambda extra: len(extra["lens"]) / 2)
        n = max(stats.pop("n_pairs"), 1.0)
        for k in ("pref_acc", "margin", "chosen_reward", "rejected_reward"):
            stats[k] = stats.pop(f"{k}_sum") / n
        return stats

    def _loss(self, out: Any, extra: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        s = sequence_sums(out.logprobs(extra["targets"]), extra["mask"], extra["lens"])
        rewards = self.beta * (s - extra["ref"])
        chosen, rejected = rewards[0::2], rewards[1::2]
        margin = chosen - rejected
        with torch.no_grad():
            stats = {"pref_acc_sum": _right(margin), "margin_sum": float(margin.sum()),
                     "chosen_reward_sum": float(chosen.sum()), "rejected_reward_sum": float(rejected.sum()),
                     "n_pairs": float(margin.numel())}
        return -F.logsigmoid(margin).sum(), stats

    @torch.no_grad()
    def evaluate(self, model: Model, batch: SequenceBatch) -> dict[str, float]:
        """Held-out preference accuracy and mean implicit reward margin, summed over dp ranks."""
        eng = model.module
        ids = batch.data[KEY]
        lens = [n for pair in batch.seqlens[KEY] for n in pair]
        lp = eng.logprobs(ids, lens, self.max_tokens_per_mb)
        sums = [0.0, 0.0, 0.0]
        if lp is not None:
            mask = action_mask(ids, batch.data["prompt_mask"], lens).float()
            ref = torch.tensor([x for pair in batch.metadata["ref_logps"] for x in pair], dtype=torch.float32)
            rewards = self.beta * (sequence_sums(lp.float(), mask, lens) - ref)
            margin = rewards[0::2] - rewards[1::2]
            sums = [_right(margin), float(margin.sum()), float(margin.numel())]
        right, margin_sum, n = eng.dp_sum(sums)
        if lp is None:
            return {}
        return {"pref_accuracy": right / max(n, 1.0), "reward_margin": margin_sum / max(n, 1.0), "n_eval": n}

    def save(self, model: Model, path: str) -> None:
        model.module.save_hf(path, tokenizer_dir=getattr(model.tokenizer, "name_or_path", None))
