"""``--check check.mismatch=true``: the generator-trainer log-prob gap, measured before a long run.

Why before: a gap (precision, kernels, batch shapes) biases every PPO ratio of the run; a user
who sees it here can change the precision or turn on a correction (TIS/MIS/IcePop) before the
hours are spent.  In this one process: the actor's checkpoint is loaded into the built-in
generation engine and the trainer's megatron engine (the doctor's rebuild,
:mod:`parallel.mismatch_rebuild`) at the actor's precision; the first prompts of the training
data are sampled with the actor's sampling settings and the trainer's log-probs of the samples
(packed as the run packs them) are compared with the generator's.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

__all__ = ["run_mismatch_check", "format_gap"]


def format_gap(g: dict[str, float]) -> str:
    """One line of gap statistics (:func:`parallel.mismatch_probe.gap_stats`)."""
    return (f"mean |Δ log p| {g['mean_abs']:.1e}, max {g['max_abs']:.1e}, k3 KL {g['k3_kl']:.1e}, "
            f"|Δ|>0.1: {100 * g['frac_gt_0.1']:.1f}% of tokens, |Δ|>1: {100 * g['frac_gt_1']:.1f}%")


def _prompts(setup: Any, tokenizer_path: str, n: int) -> Optional[list[list[int]]]:
    """The first ``n`` prompts of the training data, tokenized as the workers do (None: a user data
    source or images, which this check does not replay)."""
    from realflow.base.tokenizer_loading import load_tokenizer
    from realflow.data.source import DATA_SOURCES, load_tokenized

    if setup.dataset.format in DATA_SOURCES:
        return None
    ds = load_tokenized(setup.dataset, load_tokenizer(tokenizer_path))
    samples = [ds[i] for i in range(min(n, len(ds)))]
    if any(getattr(s, "images", None) is not None for s in samples):
        return None
    return [list(s.prompt_ids) for s in samples]


def run_mismatch_check(setup: Any, role: str, n_samples: int, max_new_tokens: int, sampling: dict[str, Any],
                       max_tokens_per_mb: Optional[int], pending: Sequence[str] = ()) -> list[str]:
    """Generate ``n_samples`` responses with model ``role`` and return the lines that report the gap."""
    from parallel.generation import EngineConfig, GenerationEngine
    from parallel.mismatch_probe import gap_stats, replay_trainer
    from parallel.mismatch_rebuild import build_trainer, dtype_of
    from realflow.api.generation import SamplingParams
    from realflow.base.devices import resolve_precision

    spec = setup.models[role]
    for path, what in ((spec.path, "the actor's checkpoint"), (setup.dataset.path, "the training data")):
        if any(path == p or path.startswith(p.rstrip("/") + "/") for p in pending):
            return [f"check.mismatch: skipped: {what} ({path}) is made by the run first; run --check again "
                    f"once it exists"]
    prompts = _prompts(setup, spec.tokenizer_path or spec.path, n_samples)
    if prompts is None:
        return ["check.mismatch: skipped: it replays text prompts of a built-in data format only"]
    if not prompts:
        return ["check.mismatch: skipped: the training data has no prompt"]
    precision = resolve_precision(setup.model_precision(spec))
    # an asynchronous run's servers may run their own precision (rollout.precision)
    gen_precision = resolve_precision(setup.generation_precision()) if setup.rollout is not None else precision
    temperature = float(sampling.get("temperature", 1.0))
    longest = max(len(p) for p in prompts) + max_new_tokens
    gen = GenerationEngine.from_hf(spec.path, EngineConfig(max_running_requests=len(prompts), max_model_len=longest),
                                   tokenizer=None, dtype=dtype_of(gen_precision))
    params = SamplingParams(max_new_tokens=max_new_tokens, **sampling, seed=setup.seed,
                            logprob_mode="raw" if temperature in (0.0, 1.0) else "sampling")
    results = [r for r in gen.generate(prompts, params) if r.output_ids]
    del gen
    if not results:
        return ["check.mismatch: skipped: every sample ended before its first token"]
    seqs = [list(r.prompt_ids) + list(r.output_ids) for r in results]
    behaviour = [torch.tensor(r.output_logprobs, dtype=torch.float32) for r in results]
    trainer = replay_trainer(build_trainer(spec.path, precision), seqs, [len(r.prompt_ids) for r in results],
                             max_tokens_per_mb, temperature if temperature > 0 else 1.0)
    g = gap_stats(behaviour, trainer.logprobs)
    sides = precision if gen_precision == precision else f"{gen_precision} (generator) / {precision} (trainer)"
    lines = [f"check.mismatch: {len(results)} samples ({g['tokens']} tokens) of {role} at {sides}, temperature "
             f"{temperature:g}, max_new_tokens {max_new_tokens}: " + format_gap(g)]
    if temperature == 0.0:
        lines.append("check.mismatch: greedy sampling (temperature 0): the gap is of the untempered log-probs")
    from experiments.mismatch_doctor import NO_MISMATCH

    if g["mean_abs"] > NO_MISMATCH:
        lines.append("check.mismatch: the sides disagree; to find why, run with mismatch_dump_every=1 for a "
                     "step or two and then: realflow doctor mismatch RUN_DIR")
    return lines
