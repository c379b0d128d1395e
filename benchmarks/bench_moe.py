"""Mixture-of-experts: the train-inference log-prob gap with and without routing replay, and the
step time of expert parallelism on this machine (issue 38).

Part A (one process): a tiny Qwen3-MoE (8 experts, top-2, HF's router init std 0.02, so many
tokens sit near a routing tie as in a real model) and a dense Qwen3 of the same shape.  The
generator is realflow's generation engine loaded from the checkpoint (as a generation server
does); the trainer is the megatron engine loaded from the same checkpoint.  Sampled outputs'
behaviour log-probs are compared with the trainer's log-probs of the same tokens, mean and max
|d log p| over output tokens, with replay off (the trainer's router decides) and on (the
generator's experts).  fp32 and bf16 (the generator and the trainer both in the precision).
Goal: with replay on, the MoE gap is within the dense model's gap.

Part B (two ranks, gloo): a train step of a tiny MoE in d2 (every rank all experts) and in d2e2
(each rank half the experts; tokens reach them through megatron's all-to-all over gloo).

    python benchmarks/bench_moe.py [--quick]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from parallel.testing import make_tiny_hf, run_cases  # noqa: E402

SHAPE = dict(vocab_size=160, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256, intermediate_size=128)
MOE = dict(SHAPE, family="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
DENSE = dict(SHAPE, family="qwen3")


def _model(path: str, kw: dict, seed: int) -> str:
    _, model = make_tiny_hf(path, seed=seed, **kw)
    if kw["family"] == "qwen3_moe":  # HF's router init (make_tiny_hf makes it decisive for exactness tests)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0.0, 0.02)
        model.save_pretrained(path)
    return path


def _gap(path: str, precision: str, n_prompts: int, new_tokens: int) -> dict[str, float]:
    import torch.distributed as dist

    from parallel.engine import MegatronEngine
    from parallel.generation import EngineConfig, GenerationEngine
    from parallel.groups import ParallelStrategy, build_model_groups
    from parallel.model_config import precision_overrides
    from realflow.api.generation import SamplingParams
    from realflow.api.routing import routed_experts_tensor

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        dist.init_process_group("gloo", rank=0, world_size=1)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    gen = GenerationEngine.from_hf(path, EngineConfig(max_running_requests=n_prompts, max_model_len=128),
                                   tokenizer=None, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 150, (12,), generator=g).tolist() for _ in range(n_prompts)]
    results = gen.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=3,
                                                   ignore_eos=True))
    trainer = MegatronEngine(path, build_model_groups([0], ParallelStrategy()), path, optimizer_config=None,
                             config_overrides=precision_overrides(precision))
    ids, lens, routes, behaviour, mask = [], [], [], [], []
    for p, r in zip(prompts, results):
        seq = p + r.output_ids
        ids += seq
        lens.append(len(seq))
        behaviour.append(torch.cat([torch.zeros(len(p) - 1), torch.tensor(r.output_logprobs, dtype=torch.float32),
                                    torch.zeros(1)]))
        mask.append(torch.cat([torch.zeros(len(p) - 1), torch.ones(len(r.output_ids)), torch.zeros(1)]).bool())
        if r.routed_experts is not None:
            routes.append(routed_experts_tensor(r.routed_experts, len(seq)))
    ids_t, behaviour_t, mask_t = torch.tensor(ids), torch.cat(behaviour), torch.cat(mask)
    out: dict[str, float] = {}
    variants = {"off": None, "on": torch.cat(routes)} if routes else {"dense": None}
    for name, rt in variants.items():
        lp = trainer.logprobs(ids_t, lens, routed_experts=rt).float()
        d = (lp - behaviour_t).abs()[mask_t]
        out[f"{name}_mean"], out[f"{name}_max"] = float(d.mean()), float(d.max())
        if trainer.moe_step is not None and rt is not None:
            t = trainer.moe_step.totals[0]
            out["flipped"] = t["differs"] / max(t["replayed"], 1.0)  # token-layers the trainer routes otherwise
    return out


def part_a(quick: bool) -> None:
    n, new = (8, 16) if quick else (32, 48)
    print(f"A. train-inference |d log p| over sampled output tokens ({n} prompts x {new} tokens, T=1)")
    print(f"{'precision':<10}{'model':<22}{'mean':>12}{'max':>12}   vs dense")
    with tempfile.TemporaryDirectory() as tmp:
        moe, dense = _model(os.path.join(tmp, "moe"), MOE, 3), _model(os.path.join(tmp, "dense"), DENSE, 3)
        for precision in ("fp32", "bf16"):
            base = _gap(dense, precision, n, new)
            m = _gap(moe, precision, n, new)
            print(f"{precision:<10}{'dense (reference)':<22}{base['dense_mean']:>12.2e}{base['dense_max']:>12.2e}")
            for name, label in (("off", "MoE, replay off"), ("on", "MoE, replay on (R3)")):
                ratio = m[f"{name}_max"] / max(base["dense_max"], 1e-12)
                print(f"{'':<10}{label:<22}{m[f'{name}_mean']:>12.2e}{m[f'{name}_max']:>12.2e}   max x{ratio:.2f}")
            print(f"{'':<10}token-layers the trainer's router routes differently: {100 * m['flipped']:.2f}%")


# --------------------------------------------------------------------------- part B (2 ranks)

STEP_MODEL = dict(MOE, hidden_size=128, head_dim=32, moe_intermediate_size=128, num_experts=8)
TOKENS_PER_RANK, STEPS = 2048, 6


def _step_case(ctx, layout: str) -> dict:
    from parallel.engine import MegatronEngine
    from parallel.groups import build_model_groups
    from parallel.optim import EngineOptimizerConfig
    from realflow.api.allocation import parse_strategy

    s = parse_strategy(layout)
    path = os.path.join(ctx.tmpdir, "m")
    eng = MegatronEngine(path, build_model_groups([0, 1], s), path, seed=1,
                         optimizer_config=EngineOptimizerConfig(lr=1e-4, total_train_steps=STEPS + 2))
    g = torch.Generator().manual_seed(10 + ctx.rank)
    lens = [128] * (TOKENS_PER_RANK // 128)
    ids = torch.randint(0, STEP_MODEL["vocab_size"], (sum(lens),), generator=g)
    extra = {"targets": torch.roll(ids, -1), "mask": torch.ones(len(ids))}

    def loss(out, ex):
        return -(out.logprobs(ex["targets"]) * ex["mask"]).sum(), {}

    mbs = [(ids[i:i + 512], lens[:4], {k: v[i:i + 512] for k, v in extra.items()}) for i in range(0, len(ids), 512)]
    times = []
    for k in range(STEPS + 1):
        t0 = time.perf_counter()
        eng.train_batch(mbs, loss, lambda ex: float(ex["mask"].sum()))
        if k:  # the first step warms up
            times.append(time.perf_counter() - t0)
    return {"step_s": sorted(times)[len(times) // 2]}


def case_setup(ctx):
    import torch.distributed as dist

    if ctx.rank == 0:
        make_tiny_hf(os.path.join(ctx.tmpdir, "m"), seed=5, **STEP_MODEL)
    dist.barrier()


def case_d2(ctx):
    return _step_case(ctx, "d2")


def case_d2e2(ctx):
    return _step_case(ctx, "d2e2")


def part_b() -> None:
    mod = "bench_moe"
    res = run_cases([f"{mod}:case_setup", f"{mod}:case_d2", f"{mod}:case_d2e2"], world_size=2, timeout=900,
                    pythonpath=[os.path.dirname(os.path.abspath(__file__))])
    for c in ("case_d2", "case_d2e2"):
        assert res[c].ok, res[c].error
    d2 = max(v["step_s"] for v in res["case_d2"].data.values())
    e2 = max(v["step_s"] for v in res["case_d2e2"].data.values())
    print(f"B. train step, tiny MoE (hidden 128, 8 experts top-2, {TOKENS_PER_RANK} tokens per rank, 4 micro-batches)")
    print(f"   d2   (all experts on each rank):          {d2 * 1e3:8.1f} ms  (baseline)")
    print(f"   d2e2 (4 experts per rank, all-to-all):    {e2 * 1e3:8.1f} ms  x{e2 / d2:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer samples")
    ap.add_argument("--part", choices=("a", "b", "both"), default="both")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.part in ("b", "both"):
        part_b()
    if args.part in ("a", "both"):
        part_a(args.quick)


if __name__ == "__main__":
    main()
