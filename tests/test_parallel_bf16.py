"""bf16 parameters (``precision=bf16``; the default on GPUs), checked on the CPU.

A bf16 engine must be bf16 throughout (norm weights included: the generation engine
shares its tensors and computes in one dtype -- a bf16 model with fp32 norms failed on
the H200 in sync GRPO's evaluate with "mat1 and mat2 must have the same dtype");
its training follows fp32 training within BF16_LOSS_RTOL; generation from the shared
bf16 parameters gives tokens whose log-probs the engine's own forward confirms
within BF16_LOGPROB_ATOL.
"""
from __future__ import annotations

import os

import torch

from parallel.testing import make_tiny_hf, run_cases

MODULE = __name__.rsplit(".", 1)[-1]
BF16_LOSS_RTOL = 0.03
BF16_LOGPROB_ATOL = 0.1  # bf16 keeps ~3 significant digits; logits of a few units
BF16 = {"bf16": True, "params_dtype": torch.bfloat16}


def case_bf16(ctx):
    from parallel.engine import MegatronEngine
    from parallel.generation import EngineConfig, GenerationEngine
    from parallel.groups import ParallelStrategy, build_model_groups
    from realflow.api.generation import SamplingParams
    from test_parallel_engine_dp import _global_batch, _micro_batch, _opt_cfg, loss_fn, loss_weight_fn

    path = os.path.join(ctx.tmpdir, "qwen2")
    cfg, _ = make_tiny_hf(path, "qwen2", seed=7, tie_word_embeddings=False)
    groups = build_model_groups([0], ParallelStrategy(1, 1, 1))
    out = {}
    for name, overrides in (("fp32", None), ("bf16", BF16)):
        eng = MegatronEngine(cfg, groups, path, optimizer_config=_opt_cfg(), seed=1, config_overrides=overrides)
        out[f"{name}_dtypes"] = sorted({str(p.dtype) for p in eng.module.parameters()})
        out[f"{name}_losses"] = [eng.train_batch([_micro_batch(_global_batch(k, cfg.vocab_size))], loss_fn,
                                                 loss_weight_fn)["loss"] for k in range(3)]
    gen = GenerationEngine.from_megatron(eng, EngineConfig(max_running_requests=4))
    prompts = [[5, 6, 7], list(range(10, 27))]
    res = gen.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    worst = 0.0
    for p, r in zip(prompts, res):
        seq = torch.tensor(p + r.output_ids)
        lp = eng.logprobs(seq, [len(seq)])  # lp[t] = log p(seq[t + 1] | ..t)
        for i, got in enumerate(r.output_logprobs):
            worst = max(worst, abs(float(got) - float(lp[len(p) - 1 + i])))
    out["worst_logprob_gap"] = worst
    out["gen_dtype"] = str(gen.weights.dtype)
    return out


def test_bf16_engine_trains_and_generates_in_one_dtype():
    res = run_cases([f"{MODULE}:case_bf16"], world_size=1, timeout=240,
                    pythonpath=[os.path.dirname(os.path.abspath(__file__))])["case_bf16"]
    assert res.ok, res.error
    d = res.data[0]
    assert d["fp32_dtypes"] == ["torch.float32"]
    assert d["bf16_dtypes"] == ["torch.bfloat16"], d["bf16_dtypes"]  # norms too
    assert d["gen_dtype"] == "torch.bfloat16"
    for a, b in zip(d["bf16_losses"], d["fp32_losses"]):
        assert abs(a - b) <= BF16_LOSS_RTOL * abs(b), (d["bf16_losses"], d["fp32_losses"])
    assert d["worst_logprob_gap"] < BF16_LOGPROB_ATOL, d["worst_logprob_gap"]
