"""The PPO critic (values per token, clipped value loss) and the reference model (logprobs).

Both run on megatron engines in any layout; outputs come back on each data-parallel
head (other ranks return None, see ``parallel.engine``). The critic computes the same
advantages and returns as the actor (:mod:`mfc.rl_batch`), so the two train steps are
independent MFCs that may run at the same time on disjoint workers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from mfc.losses import aggregation_weight, value_loss
from mfc.ppo_actor import knobs_for, logprobs_batch
from mfc.ppo_config import PPOConfig
from mfc.rl_batch import WORK_KEYS, KLPenalty, flat_seqlens, run_ppo_updates
from realflow.api.batch import MicroBatchSpec, SequenceBatch
from realflow.api.engine import has_adapters
from realflow.api.interface import Model, ModelInterface, register_interface
from realflow.api.keys import INPUT_IDS, REF_LOGPROBS, VALUES


@register_interface("ppo_critic")
@dataclass
class PPOCriticInterface(ModelInterface):
    # the same knobs as the actor's (mfc.ppo_config; a dict of its fields from the wire): the critic
    # computes the same advantages and returns, and trains with value_eps_clip on the same schedule
    ppo: PPOConfig = field(default_factory=PPOConfig)
    max_new_tokens: int = 0  # the generation's length limit (the overlong punishment's)
    loss_agg: str = "token-mean"  # the value loss's aggregation
    seed: int = 1

    def __post_init__(self) -> None:
        self.ppo = knobs_for(self.ppo, self.max_new_tokens)
        self.kl = KLPenalty(self.ppo)
        self._step = 0

    def inference(self, model: Model, batch: SequenceBatch, mb_spec: MicroBatchSpec) -> Optional[SequenceBatch]:
        lens = flat_seqlens(batch)
        v = model.module.values(batch.data[INPUT_IDS], lens, mb_spec.max_tokens_per_mb)
        if v is None:
            return None
        return SequenceBatch(list(batch.ids), {VALUES: batch.seqlens[INPUT_IDS]}, {VALUES: v.float()})

    def train_step(self, model: Model, batch: SequenceBatch, mb_spec: MicroBatchSpec) -> dict[str, float]:
        eng = model.module
        t, _ = self.kl.rl_tensors(batch, self.ppo, eng.dp_sum, self.max_new_tokens)
        up = run_ppo_updates(eng, batch, t, mb_spec, epochs=self.ppo.ppo_epochs, n_minibatches=self.ppo.n_minibatches,
                             seed=self.seed, step=self._step,
                             micro_batch=lambda mb, lens: {"mask": mb.data["_mask"].bool(), "old": mb.data["_old_v"],
                                                           "ret": mb.data["_ret"], "lens": lens},
                             loss_fn=self._loss, weight_fn=self._weight)
        totals, n = up.totals, up.n_updates
        self._step += 1
        out = {k: totals[k] / n for k in ("loss", "grad_norm", "lr") if k in totals}
        out["nonfinite_skipped"] = totals.get("nonfinite_skipped", 0.0)
        out.update({k: totals[k] for k in WORK_KEYS if k in totals})  # (padding: the gap)
        n_tok = max(totals.get("n_loss_tokens", 0.0), 1.0)
        for k, v in totals.items():
            if k.endswith("_sum"):
                out[k[:-4]] = v / n_tok
        return out

    def _loss(self, outputs: Any, extra: dict) -> tuple[torch.Tensor, dict[str, float]]:
        return value_loss(outputs.values(), extra["old"], extra["ret"], extra["mask"], self.ppo.value_eps_clip,
                          seqlens=extra["lens"], agg=self.loss_agg)

    def _weight(self, extra: dict) -> float:
        return float(aggregation_weight(extra["mask"], extra["lens"], self.loss_agg))

    def save(self, model: Model, path: str) -> None:
        model.module.save_hf(path, tokenizer_dir=getattr(model.tokenizer, "name_or_path", None))


@register_interface("ppo_ref")
@dataclass
class PPORefInterface(ModelInterface):
    """Reference-model logprobs of the generated sequences (for the KL penalty), at the
    actor's sampling temperature so that the KL compares the same kind of distribution."""

    temperature: float = 1.0
    #: run on the actor's engine with its LoRA adapters off: the base model is the reference
    adapters_off: bool = False

    def inference(self, model: Model, batch: SequenceBatch, mb_spec: MicroBatchSpec) -> Optional[SequenceBatch]:
        if not self.adapters_off:
            return logprobs_batch(model, batch, mb_spec, REF_LOGPROBS, self.temperature)
        engine = model.module
        if not has_adapters(engine):
            raise ValueError(f"ppo_ref with adapters_off=True runs on a model that trains LoRA adapters; "
                             f"model {model.name!r} has none (enable model.lora or give the reference its own model)")
        with engine.adapters_disabled():
            return logprobs_batch(model, batch, mb_spec, REF_LOGPROBS, self.temperature)
