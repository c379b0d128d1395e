"""A synchronous PPO step, broken down into generation / reallocation / inference / training.

One command:  python benchmarks/bench_sync_ppo.py [--experiment ppo-math] [--steps 20] [--fileroot DIR]

Runs the real job (launcher, master, 2 model workers) with the embedded default model:
the actor trains at d1t2 and generates at d2, so every step reallocates its weights
(train layout -> generation layout before ``actor_gen``; the generation copy is released
after it). ``ppo-math`` also runs reference and critic inference and a critic update.
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
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", default="ppo-math", help="ppo-math | grpo-math")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--fileroot", default="", help="reuse a fileroot (its SFT checkpoint); default: a temp dir")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides")
    args = ap.parse_args()
    root = args.fileroot or tempfile.mkdtemp(prefix="bench_sync_ppo_")
    overrides = [f"fileroot={root}", f"max_train_steps={args.steps}", "trial_name=bench", "trace=false"]
    if args.experiment == "ppo-math":
        overrides.append("ppo.kl_coef=0.01")  # include the reference model's inference
    cmd = [sys.executable, "-m", "realflow.apps.main", f"experiment={args.experiment}", *overrides, *args.overrides]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        sys.exit(f"run failed ({res.returncode}):\n{res.stderr[-3000:]}")
    with open(os.path.join(root, args.experiment, "bench", "stats.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if "time/step" in r][args.warmup:]
    if not rows:
        sys.exit("no steps after warm-up; raise --steps")

    def mean(key: str) -> float:
        return statistics.mean(r.get(key, 0.0) for r in rows)

    realloc = mean("actor_gen/hooks_pre_s") + mean("actor_gen/hooks_post_s")
    other_hooks = sum(mean(k) for k in rows[0] if k.endswith(("hooks_pre_s", "hooks_post_s"))
                      and not k.startswith("actor_gen/"))
    gen = mean("time/actor_gen") - realloc
    infer_keys = [k for k in rows[0] if k.startswith("time/") and k.endswith("_inf")]
    infer = max((mean(k) for k in infer_keys), default=0.0)  # one concurrent generation of inference MFCs
    train_keys = [k for k in rows[0] if k.startswith("time/") and k.endswith("_train")]
    train = max((mean(k) for k in train_keys), default=0.0)
    step = mean("time/step")
    parts = {"generation": gen, "reallocation (train->gen layout, release after)": realloc,
             "inference (reward/ref/critic)": infer, "training (actor/critic)": train,
             "other hooks (offload/reload/EMA)": other_hooks}
    parts["dispatch + data movement + rest"] = step - sum(parts.values())
    print(f"{args.experiment}: {len(rows)} steps measured (after {args.warmup} warm-up), "
          f"{rows[-1].get('actor_train/response_len', 0):.1f} response tokens/seq")
    for name, sec in parts.items():
        print(f"  {name:<48} {sec * 1000:8.1f} ms  {100 * sec / step:5.1f}%")
    print(f"  {'step':<48} {step * 1000:8.1f} ms  100.0%")
    print(json.dumps({"experiment": args.experiment, "step_s": round(step, 4),
                      **{k: round(v, 4) for k, v in parts.items()}}))


if __name__ == "__main__":
    main()
