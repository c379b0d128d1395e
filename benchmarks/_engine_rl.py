"""The ``rl`` part of ``bench_engine.py``: the default RL workloads on their default models.

What each default run generates per step, from its experiment's own config: the main job
(``main_async_ppo``, ``async-grpo-math``: 32 prompts of the worked-arithmetic task x 8 samples,
up to 96 new tokens, answers of ~16 tokens at the median and ~80 at p99) and ``main_sync_ppo``'s
(``grpo-math``: 64 arithmetic prompts x 8 samples, up to 16 new tokens); temperature 1, EOS ends a
sample, on the run's SFT start (reused from ``--fileroot``; trained first when absent).
realflow's engine (``SamplingParams(n=8)``: the group's prompt prefilled once) against
transformers ``generate(num_return_sequences=8)`` on the same prompts; both are credited the
tokens up to and with each sample's first EOS. Best of ``--rl-repeats`` runs each, in blocks of
back-to-back runs (``bench_engine.in_blocks`` says why).
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

# experiment -> what it is (the first is the README's main job)
WORKLOADS = {"async-grpo-math": "the main job (main_async_ppo)", "grpo-math": "main_sync_ppo's default"}


def part_rl(a: Any, fileroot: str, dev: Any) -> None:
    for experiment in (a.rl_workloads.split(",") if a.rl_workloads else WORKLOADS):
        if experiment not in WORKLOADS:
            raise SystemExit(f"--rl-workloads: no {experiment!r} (one of {', '.join(WORKLOADS)})")
        _workload(a, fileroot, dev, experiment)


def _paths(experiment: str, fileroot: str) -> tuple[str, str]:
    """(the run's SFT start, its RL train file), trained / written first when absent."""
    from _realflow_steps import run_job
    from realflow.api.experiment import experiment_registry
    from realflow.config.cli import parse_overrides

    actor, _, train, _ = parse_overrides(experiment_registry.get(experiment), [f"fileroot={fileroot}"])._paths()
    if not (os.path.isfile(os.path.join(actor, "config.json")) and os.path.isfile(train)):
        run_job(experiment, fileroot, "prepare", 1, [])  # the run trains its start first
    return actor, train


def _workload(a: Any, fileroot: str, dev: Any, experiment: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench_e2e_rl import Work
    from bench_engine import in_blocks
    from parallel.generation import EngineConfig, GenerationEngine
    from realflow.api.generation import SamplingParams

    work = Work.from_defaults(experiment)
    path, data = _paths(experiment, fileroot)
    tok = AutoTokenizer.from_pretrained(path)
    with open(data) as f:
        rows = [json.loads(line) for _, line in zip(range(work.batch_size), f)]
    prompts = [tok(r["prompt"])["input_ids"] for r in rows]
    n, max_new = work.n_samples, work.max_new_tokens
    print(f"\n== rl, {WORKLOADS[experiment]} ({experiment}): {len(prompts)} prompts x {n} samples, up to {max_new} "
          f"new tokens, temperature {work.temperature}, EOS on, its SFT start ({path})")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(dev)
    engine = GenerationEngine.from_hf(path, EngineConfig(max_running_requests=len(prompts) * n), device=dev)
    params = SamplingParams(max_new_tokens=max_new, temperature=work.temperature, n=n, seed=a.seed)
    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else 0

    def run_engine() -> tuple[float, int]:
        t0 = time.perf_counter()
        res = engine.generate(prompts, params)
        return time.perf_counter() - t0, sum(len(r.output_ids) for r in res)

    def run_hf() -> tuple[float, int]:
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=work.temperature, top_p=1.0,
                                 top_k=0, max_new_tokens=max_new, num_return_sequences=n, pad_token_id=pad)
        dt = time.perf_counter() - t0
        resp = out[:, width:]
        ended = (resp == eos).cumsum(1)
        return dt, int(((ended == 0) | ((ended == 1) & (resp == eos))).sum())

    run_engine(), run_hf()  # warm-up
    repeats = a.rl_repeats or 12  # short runs (~0.1-1 s each): many, in blocks (bench_engine.in_blocks)
    runs_e, runs_h = in_blocks([run_engine, run_hf], repeats)
    eng_best, tokens_e = min((dt / n, n) for dt, n in runs_e)
    hf_best, tokens_h = min((dt / n, n) for dt, n in runs_h)
    print(f"best of {repeats} runs each, in blocks of back-to-back runs")
    print(f"transformers generate: {1 / hf_best:10.0f} tokens/s ({tokens_h} tokens a run)")
    print(f"realflow engine:       {1 / eng_best:10.0f} tokens/s ({tokens_e} tokens a run)")
    print(f"ratio engine / transformers: {hf_best / eng_best:.2f}x (goal >= 3x on the default RL workload)")
    forward, total = _forward_share(engine, run_engine, repeats)
    print(f"engine run {total * 1e3:.1f} ms, of which the model's forward (prefill + decode ops) {forward * 1e3:.1f} ms: "
          f"with no scheduling overhead at all the ratio would be {hf_best * tokens_e / forward:.2f}x")


def _forward_share(engine: Any, run: Any, repeats: int) -> tuple[float, float]:
    """(seconds in the decoder's prefill and decode calls, seconds of the whole run), best run of
    ``repeats``: how much of the engine's time is the model's torch ops, how much the scheduling
    around them (sampling, appending tokens, blocks, rows joining and leaving)."""
    dec = engine.decoder
    spent = [0.0]

    def timed(fn: Any) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[0] += time.perf_counter() - t0
        return call

    dec.decode, dec.extend = timed(dec.decode), timed(dec.extend)
    try:
        best = (float("inf"), float("inf"))
        for _ in range(repeats):
            spent[0] = 0.0
            total = run()[0]
            best = min(best, (spent[0], total), key=lambda x: x[1])
        return best
    finally:
        del dec.decode, dec.extend
