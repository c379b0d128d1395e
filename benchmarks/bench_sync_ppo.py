"""A synchronous PPO step, broken down into generation / reallocation / inference / training.

One command:  python benchmarks/bench_sync_ppo.py [--experiment ppo-math] [--steps 20] [--fileroot DIR]

Runs the real job (launcher, master, 2 model workers) with the embedded default model and
the default layout (data-parallel; add ``allocation=actor_train:d1t2,*:d2`` to see every step
reallocate the actor's weights: train layout -> generation layout before ``actor_gen``, the
generation copy released after it). ``ppo-math`` also runs reference and critic inference and a critic update.
The SFT checkpoint it starts from is produced first if absent (not timed).

Per MFC the master records the wall time of the MFC's topological generation and the
time its pre/post hooks took on the slowest participant; MFCs of one generation run
concurrently, so they share that generation's time. Reported: mean seconds per step over
the steps after the first ``--warmup`` ones, and each phase's share of the step.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _realflow_steps import breakdown, run_job  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", default="ppo-math", help="ppo-math | grpo-math")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--fileroot", default="", help="reuse a fileroot (its SFT checkpoint); default: a temp dir")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides")
    args = ap.parse_args()
    root = args.fileroot or tempfile.mkdtemp(prefix="bench_sync_ppo_")
    extra = ["ppo.kl_coef=0.01"] if args.experiment == "ppo-math" else []  # include the reference's inference
    rows = run_job(args.experiment, root, "bench", args.steps, extra + args.overrides)[args.warmup:]
    if not rows:
        sys.exit("no steps after warm-up; raise --steps")
    parts = breakdown(rows)
    step = parts.pop("step")
    print(f"{args.experiment}: {len(rows)} steps measured (after {args.warmup} warm-up), "
          f"{rows[-1].get('actor_train/response_len', 0):.1f} response tokens/seq")
    for name, sec in parts.items():
        print(f"  {name:<48} {sec * 1000:8.1f} ms  {100 * sec / step:5.1f}%")
    print(f"  {'step':<48} {step * 1000:8.1f} ms  100.0%")
    print(json.dumps({"experiment": args.experiment, "step_s": round(step, 4),
                      **{k: round(v, 4) for k, v in parts.items()}}))


if __name__ == "__main__":
    main()
