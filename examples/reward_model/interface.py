"""Bradley-Terry reward model: a scalar score per sequence, trained so that the chosen
response of each pair scores above the rejected one.

The model is realflow's critic build (``backend_args={"critic": True}``: the LM trunk with a
one-output head, saved as a token-classification checkpoint); a sequence's score is the
head's value at its last token (the eos). Loss per pair: ``-log sigmoid(r_chosen -
r_rejected)``. Works in any (dp, tp, pp) layout: scores come from the engine's packed
per-token values, which it computes on the last pipeline stage.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from realflow.api.batch import MicroBatchSpec, SequenceBatch
from realflow.api.interface import Model, ModelInterface, register_interface

KEY = "packed_input_ids"


def _pair_ends(seqlens: list[int]) -> torch.Tensor:
    """Index of every sequence's last token in the packed micro-batch (chosen, rejected, ...)."""
    return torch.tensor(seqlens).cumsum(0) - 1


def pair_scores(values: torch.Tensor, seqlens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen scores, rejected scores) from packed per-token values."""
    last = values[_pair_ends(seqlens)]
    return last[0::2], last[1::2]


def pairs_right(margin: torch.Tensor) -> float:
    """Pairs ranked right, a tie counting half (a fresh head scores everything 0: accuracy 0.5)."""
    return float((margin > 0).sum() + 0.5 * (margin == 0).sum())


def _bt_loss(out: Any, extra: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    chosen, rejected = pair_scores(out.values(), extra["lens"])
    margin = chosen - rejected
    with torch.no_grad():
        stats = {"pair_acc_sum": pairs_right(margin), "margin_sum": float(margin.sum()),
                 "n_pairs": float(margin.numel())}
    return -F.logsigmoid(margin).sum(), stats


@register_interface("bradley_terry")
@dataclass
class BradleyTerryInterface(ModelInterface):
    """``train_step``: the mean pair loss; ``evaluate``: held-out pair accuracy and margin."""

    max_tokens_per_mb: Optional[int] = None  # for evaluation (training uses the MFC's mb_spec)

    def train_step(self, model: Model, batch: SequenceBatch, mb_spec: MicroBatchSpec) -> dict[str, float]:
        mbs = []
        for mb in batch.micro_batches(mb_spec):
            lens = [n for pair in mb.seqlens[KEY] for n in pair]
            mbs.append((mb.data[KEY], lens, {"lens": lens}))
        stats = model.module.train_batch(mbs, _bt_loss, lambda extra: len(extra["lens"]) / 2)
        n = max(stats.pop("n_pairs"), 1.0)
        stats["pair_acc"] = stats.pop("pair_acc_sum") / n
        stats["margin"] = stats.pop("margin_sum") / n
        return stats

    @torch.no_grad()
    def evaluate(self, model: Model, batch: SequenceBatch) -> dict[str, float]:
        """Pair accuracy (chosen scored higher; a tie counts half) and mean margin over this dp rank's held-out
        pairs, summed over dp ranks; reported by the output ranks (last stage, tp rank 0)."""
        eng = model.module
        lens = [n for pair in batch.seqlens[KEY] for n in pair]
        values = eng.values(batch.data[KEY], lens, self.max_tokens_per_mb)
        sums = [0.0, 0.0, 0.0]
        if values is not None:
            chosen, rejected = pair_scores(values, lens)
            sums = [pairs_right(chosen - rejected), float((chosen - rejected).sum()), float(chosen.numel())]
        correct, margin, n = eng.dp_sum(sums)
        if values is None:
            return {}
        return {"pair_accuracy": correct / max(n, 1.0), "margin": margin / max(n, 1.0), "n_eval": n}

    def save(self, model: Model, path: str) -> None:
        model.module.save_hf(path, tokenizer_dir=getattr(model.tokenizer, "name_or_path", None))
