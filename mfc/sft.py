"""SFT interface: token-normalised NLL on answer tokens, and held-out evaluation (final-answer
exact match, or a registered reward such as ``code-tests`` via ``eval_reward``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mfc.images import has_images, sample_images, sequence_images
from mfc.packed import next_token_targets
from mfc.reward import held_out_scores
from realflow.api.batch import MicroBatchSpec, SequenceBatch
from realflow.api.engine import TokenOutputs, runs_pad_free
from realflow.api.images import IMAGES_EXTRA
from realflow.api.interface import Model, ModelInterface, register_interface


@register_interface("sft")
@dataclass
class SFTInterface(ModelInterface):
    """Trains on the response tokens of (prompt, response) pairs.

    The loss is the negative log-likelihood summed over response tokens and
    divided by the number of response tokens in the *global* batch (the engine
    all-reduces that count), so the update does not depend on how the batch is
    split over data-parallel ranks or micro-batches.
    """

    eval_max_new_tokens: int = 16
    eval_reward: str = ""  # "" = final-answer exact match; else a registered reward (mean = accuracy)
    eval_reward_args: dict[str, Any] = field(default_factory=dict)

    def train_step(self, model: Model, batch: SequenceBatch, mb_spec: MicroBatchSpec) -> dict[str, float]:
        micro_batches, ids = [], []
        for mb in batch.micro_batches(mb_spec, packed=runs_pad_free(model.module)):
            ids.append(mb.ids)
            tokens = mb.data["packed_input_ids"]
            seqlens = [n for lens in mb.seqlens["packed_input_ids"] for n in lens]
            targets, valid = next_token_targets(tokens, seqlens)
            # a target counts if it is a response token (not prompt) and inside its sequence
            loss_mask = valid & ~torch.roll(mb.data["prompt_mask"], -1)
            extra = {"targets": targets, "mask": loss_mask, "ids": mb.ids}
            if has_images(mb):  # VL rows: each sequence's images
                extra[IMAGES_EXTRA] = sequence_images(mb)
            micro_batches.append((tokens, seqlens, extra))
        # the batch's longest sequence: what a padded engine pays per sequence (the planner's workload);
        # reduced before train_batch, which may raise on one rank only (a non-finite loss in stop mode)
        longest = model.module.dp_max([float(max((n for _, lens, _ in micro_batches for n in lens), default=0))])[0]
        stats = model.module.train_batch(micro_batches, self.loss, _n_loss_tokens, sample_ids=ids)
        # caller stats come back summed over micro-batches and dp ranks
        stats["token_acc"] = stats.pop("token_acc_sum") / max(stats.pop("n_loss_tokens"), 1.0)
        stats["seq_len_max"] = longest
        return stats

    def loss(self, outputs: TokenOutputs, extra: dict) -> tuple[torch.Tensor, dict[str, float]]:
        """One micro-batch's loss SUM and stats (a method, so a subclass can shape it)."""
        return _nll_loss(outputs, extra)

    def evaluate(self, model: Model, batch: SequenceBatch) -> dict[str, float]:
        """Greedy-decode every prompt of this dp rank's shard; mean score (``eval_reward``, default
        exact match) summed over ranks."""
        key = "packed_prompts" if "packed_prompts" in batch.data else "packed_input_ids"
        prompts = []
        for i in range(len(batch)):
            seq = batch.sequences(key, i)[0]
            if key == "packed_input_ids":
                seq = seq[batch.sequences("prompt_mask", i)[0].bool()]
            prompts.append(seq.tolist())
        tok = model.tokenizer
        kw = {"images": [sample_images(batch, i) for i in range(len(batch))]} if has_images(batch) else {}
        outputs = model.module.greedy_generate(prompts, self.eval_max_new_tokens, tok.eos_token_id, **kw)
        texts = [tok.decode(out, skip_special_tokens=True) for out in outputs]
        correct = sum(held_out_scores(texts, batch.metadata["answer"], self.eval_reward, self.eval_reward_args))
        n_correct, n_total = model.module.dp_sum([correct, float(len(prompts))])
        return {"accuracy": n_correct / max(n_total, 1.0), "n_eval": n_total}

    def save(self, model: Model, path: str) -> None:
        model.module.save_hf(path, tokenizer_dir=getattr(model.tokenizer, "name_or_path", None))


def _nll_loss(out: TokenOutputs, extra: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """``out`` is the engine's per-token view (parallel.outputs.TokenOutputs): log-probs
    and argmax are computed on the vocab shards, so this works in any (tp, pp) layout."""
    mask = extra["mask"]
    logp = out.logprobs(extra["targets"])
    loss_sum = -(logp * mask).sum()
    with torch.no_grad():
        hits = ((out.argmax() == extra["targets"]) & mask).sum()
    return loss_sum, {"token_acc_sum": float(hits), "n_loss_tokens": float(mask.sum())}


def _n_loss_tokens(extra: dict[str, Any]) -> float:
    return float(extra["mask"].sum())
