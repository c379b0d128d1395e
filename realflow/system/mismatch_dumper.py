"""Writes the mismatch doctor's dumps from a train MFC (format: :mod:`realflow.system.mismatch_dump`).

Why in the worker, before the interface runs: the dump must hold the weights that the trainer
compares with the generator (the version that generated a synchronous batch, the proximal one of
an asynchronous batch), and the train step changes them. Every rank of the MFC takes part (the
HF save is collective over the model's ranks); the head of data-parallel rank 0 writes the samples.
"""
from __future__ import annotations

import os
from typing import Any

from realflow.api.batch import SequenceBatch
from realflow.api.keys import LOGPROBS, ROUTED_EXPERTS
from realflow.base.devices import resolve_precision
from realflow.system.mismatch_dump import WEIGHTS_DIR, MismatchDump, dump_dir, dump_samples, write_dump

__all__ = ["MismatchDumper"]


class MismatchDumper:
    """Every ``every``-th train step of an MFC whose batch has behaviour log-probs, before it updates."""

    def __init__(self, setup: Any, every: int, n_samples: int) -> None:
        self.setup, self.every, self.n = setup, every, n_samples

    def wanted(self, step: int, batch: SequenceBatch) -> bool:
        return self.every > 0 and step % self.every == 0 and LOGPROBS in batch.data

    def dump(self, call: Any, step: int, batch: SequenceBatch, writes_samples: bool) -> str:
        """Save the weights (every rank of ``call``) and, where ``writes_samples``, the samples."""
        mfc, model = call.mfc, call.model
        d = dump_dir(self.setup.run_dir, step)
        os.makedirs(d, exist_ok=True)
        model.module.save_hf(os.path.join(d, WEIGHTS_DIR),
                             tokenizer_dir=getattr(model.tokenizer, "name_or_path", None))
        if writes_samples:
            spec = self.setup.models[mfc.model_name]
            precision = resolve_precision(self.setup.model_precision(spec))
            rollout = self.setup.rollout
            gen = resolve_precision(self.setup.generation_precision()) if rollout is not None else precision
            args = mfc.interface_args or {}
            settings = {
                "trainer_precision": precision,
                # a synchronous run's generator shares the trainer's weights; servers: rollout.precision
                "gen_precision": gen,
                "engine": rollout.backend if rollout is not None else "builtin",
                "asynchronous": rollout is not None,
                "temperature": float(args.get("temperature", 1.0)),
                "max_tokens_per_mb": mfc.mb_spec.max_tokens_per_mb,
                "layout": str(getattr(call, "layout", "")),
                "mfc": mfc.name,
                "routing_replay": ROUTED_EXPERTS in batch.data,  # (MoE) the trainer used the generator's experts
            }
            write_dump(self.setup.run_dir, MismatchDump(step=step, model=mfc.model_name,
                                                        weights_version=int(model.version), settings=settings,
                                                        samples=dump_samples(batch, self.n, int(model.version))))
        return d
