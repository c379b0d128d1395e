"""What the non-finite checks cost a train step (issue 22: at most 2% on the default model).

    python benchmarks/bench_nonfinite.py [--steps 30]

One process, one engine of the CPU default model (experiments/init_model.py: Qwen2, hidden 128,
3 layers, tied embeddings; a 2k-token vocabulary like the default tokenizer's), trained on the
same packed batch (the default SFT batch's size: 128 sequences of ~40 tokens, one micro-batch).
Steps alternate between the engine's checked step (loss and gradient-norm checks before the
update, the parameter check after it: ``MegatronEngine._checked_step``) and megatron's own
``optimizer.step()`` (what the engine did before the checks), so machine noise hits both
alike. Prints the median step time of each and the overhead.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GOAL = 0.02


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import socket

    import torch.distributed as dist

    from experiments.init_model import TinyArchConfig, planned_hf_config
    from parallel.engine import MegatronEngine
    from parallel.groups import build_model_groups
    from parallel.optim import EngineOptimizerConfig
    from realflow.api.allocation import ParallelStrategy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    cfg = dict(planned_hf_config(TinyArchConfig()), vocab_size=2048)
    cfg.pop("vocab_size_unknown")
    eng = MegatronEngine(cfg, build_model_groups([0], ParallelStrategy()), None,
                         EngineOptimizerConfig(lr=1e-4, total_train_steps=10 * args.steps), seed=1)
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(24, 57, (128,), generator=g).tolist()
    ids = torch.randint(0, cfg["vocab_size"], (sum(lens),), generator=g)
    targets = torch.roll(ids, -1)

    def loss(out, extra):
        return -out.logprobs(targets).sum(), {}

    checked = eng._checked_step

    def megatron_step(bad_loss):  # the step before the checks: megatron's own, unchecked
        ok, norm, _ = eng.optimizer.step()
        eng.scheduler.step(increment=1)
        return bool(ok), float(norm or 0.0)

    times: dict[str, list[float]] = {"checked": [], "megatron": []}
    for i in range(2 * args.steps + 4):
        name = "checked" if i % 2 == 0 else "megatron"
        eng._checked_step = checked if name == "checked" else megatron_step
        t0 = time.perf_counter()
        eng.train_batch([(ids, lens, None)], loss, lambda _: float(len(ids)))
        if i >= 4:  # warm-up
            times[name].append(time.perf_counter() - t0)
    a, b = statistics.median(times["checked"]), statistics.median(times["megatron"])
    # each checked step against the unchecked one right after it: drift of the machine cancels
    over = statistics.median(x / y for x, y in zip(times["checked"], times["megatron"])) - 1
    # the one piece of work the checks add (megatron computes the gradient norm anyway to clip):
    # the sums over the parameters, timed alone so run-to-run noise of whole steps cannot hide it
    from parallel.nonfinite import params_finite

    checks = []
    for _ in range(50):
        t0 = time.perf_counter()
        params_finite(eng.module.parameters())
        checks.append(time.perf_counter() - t0)
    own = statistics.median(checks) / b
    print(f"default model, {len(lens)} sequences / {sum(lens)} tokens per step, {args.steps} steps each")
    print(f"  megatron optimizer.step (unchecked): {b * 1e3:8.2f} ms per train step")
    print(f"  checked step (loss, grad norm, params): {a * 1e3:8.2f} ms per train step")
    print(f"  parameter check alone: {statistics.median(checks) * 1e3:.3f} ms = {own:.3%} of a step")
    print(f"overhead: {over:+.2%} (median over adjacent pairs of steps; goal <= {GOAL:.0%}): "
          f"{'met' if over <= GOAL else 'NOT met'}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
