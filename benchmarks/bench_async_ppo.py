"""Asynchronous vs synchronous GRPO on the same 2 cores, task, model, hyper-parameters and samples.

One command (``python benchmarks/bench_async_ppo.py``). Both runs start from the same SFT
checkpoint (made first under ``--fileroot`` if absent) and train ``--steps`` steps of
``--batch`` prompts with ``--n-samples`` answers each, through the real launchers:

* synchronous: ``main_sync_ppo`` with ``--sync-allocation`` (default ``d2``: every MFC data-parallel
  over both workers, no reallocation -- the fastest synchronous layout measured on 2 cores, 0.5 s
  vs 0.85 s per default GRPO step for its own default ``actor_train:d1t2,*:d2``);
* asynchronous: ``main_async_ppo`` with ``--async-allocation`` (default ``gen:d1+train:d1``)
  and ``--eta``.

Printed for each: trained samples/s (prompts trained per second of training wall time:
from the end of the first evaluation to the last step), the busy fraction of generation
and of training, the reward curve (mean training reward per tenth of the run) and
held-out pass@1 before/after; then the speed ratio (goal: >= 2x at equal final pass@1
within seed noise) and the training time each run needs to reach the synchronous run's
final pass@1 (from held-out evaluations every ``--eval-every`` steps; their own time is
excluded from every figure). Extra ``key=value`` arguments go to both runs (e.g. a task's data set).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _run(app: str, fileroot: str, trial: str, args: list[str]) -> tuple[str, str]:
    cmd = [sys.executable, "-m", f"realflow.apps.{app}", f"fileroot={fileroot}", f"trial_name={trial}", *args]
    print("$", " ".join(cmd[1:]), flush=True)
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=7200)
    if res.returncode != 0:
        raise SystemExit(f"{app} failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    return res.stdout, res.stderr


def _summary(stdout: str, run_dir: str) -> dict[str, Any]:
    with open(os.path.join(run_dir, "stats.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in rows if "actor_train/reward" in r]
    t0 = next(r["time"] for r in rows if r["step"] == 0)
    wall = steps[-1]["time"] - t0
    m = re.search(r"held-out sampled_accuracy: ([\d.]+) -> ([\d.]+)", stdout)
    gen = sum(r.get("time/actor_gen", 0.0) for r in steps)
    train = sum(v for r in steps for k, v in r.items()
                if k.startswith("time/") and k not in ("time/step", "time/fetch", "time/actor_gen",
                                                       "time/reward_inf"))
    if "async/gen_busy_frac" in steps[0]:  # the servers' own busy time, per step
        gen = sum(r["async/gen_busy_frac"] * (r["time"] - p["time"]) for p, r in zip([rows[0], *steps], steps))
    # held-out pass@1 over training time (evaluations themselves excluded): (seconds, pass@1)
    evals, spent, prev = [], 0.0, t0
    for r in rows:
        if "eval/sampled_accuracy" in r and r["step"] > 0:
            evals.append((prev - t0 - spent, r["eval/sampled_accuracy"]))  # training seconds so far
            if r["time"] < steps[-1]["time"]:
                spent += r["time"] - prev  # this evaluation's own duration (it follows a step's row)
        elif "eval/sampled_accuracy" in r:
            evals.append((0.0, r["eval/sampled_accuracy"]))
        prev = r["time"]
    tenth = max(1, len(steps) // 10)
    curve = [sum(r["actor_train/reward"] for r in steps[i:i + tenth]) / len(steps[i:i + tenth])
             for i in range(0, len(steps), tenth)]
    return {"wall": wall - spent, "evals": evals, "steps": len(steps), "gen_busy": gen / wall, "train_busy": train / wall, "curve": curve,
            "pass1": (float(m.group(1)), float(m.group(2))) if m else (float("nan"), float("nan"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--n-samples", type=int, default=8)
    ap.add_argument("--eta", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5, help="actor learning rate of both runs (the async default)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--task", default="worked_arithmetic", help="dataset.task of both runs")
    ap.add_argument("--sync-allocation", default="d2")
    ap.add_argument("--async-allocation", action="append", default=None,
                    help="repeatable: one asynchronous run per allocation, each against the same synchronous run "
                         "(default gen:d1+train:d1)")
    ap.add_argument("--eval-every", type=int, default=0, help="held-out evaluation every N steps (0 = 5 per run)")
    ap.add_argument("--fileroot", default=None, help="default: a temporary directory (SFT included)")
    a, extra = ap.parse_known_args()
    tmp = None
    if a.fileroot is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench_async_")
        a.fileroot = tmp.name
    from experiments.tasks.registry import get_task

    common = [f"dataset.task={a.task}", f"ppo.max_new_tokens={get_task(a.task).response_tokens}",
              f"max_train_steps={a.steps}", f"batch_size={a.batch}", f"ppo.n_samples={a.n_samples}",
              f"actor_optimizer.lr={a.lr}", f"seed={a.seed}",
              f"eval_freq_steps={a.eval_every or max(1, a.steps // 5)}", *extra]
    out_s, _ = _run("main_sync_ppo", a.fileroot, "bench-sync", common + [f"allocation={a.sync_allocation}"])
    res = {f"sync {a.sync_allocation}": _summary(out_s, os.path.join(a.fileroot, "grpo-math", "bench-sync"))}
    for i, alloc in enumerate(a.async_allocation or ["gen:d1+train:d1"]):
        out_a, _ = _run("main_async_ppo", a.fileroot, f"bench-async{i}",
                        common + [f"allocation={alloc}", f"rollout.max_head_offpolicyness={a.eta}"])
        res[f"async {alloc}"] = _summary(out_a, os.path.join(a.fileroot, "async-grpo-math", f"bench-async{i}"))
    samples = a.steps * a.batch
    for name, r in res.items():
        r["sps"] = samples / r["wall"]
        print(f"{name}: {r['sps']:.1f} trained samples/s ({samples} in {r['wall']:.0f}s); busy: generation "
              f"{r['gen_busy']:.0%}, training {r['train_busy']:.0%}; held-out pass@1 {r['pass1'][0]:.3f} -> "
              f"{r['pass1'][1]:.3f}")
        print(f"       reward per tenth of the run: {' '.join(f'{x:.3f}' for x in r['curve'])}")
    sync_name = next(iter(res))
    base = res[sync_name]
    for name, r in list(res.items())[1:]:
        print(f"speed: {name} / {sync_name} = {r['sps'] / base['sps']:.2f}x trained samples/s (goal >= 2x); "
              f"final pass@1 difference {r['pass1'][1] - base['pass1'][1]:+.3f}")
    target = base["pass1"][1]
    for name, r in res.items():
        hit = next((t for t, acc in r["evals"] if acc >= target), None)
        print(f"time to reach the synchronous run's final pass@1 ({target:.3f}): {name} "
              + (f"{hit:.0f}s" if hit is not None else "not reached")
              + f"   (pass@1 over training seconds: {' '.join(f'{t:.0f}:{acc:.3f}' for t, acc in r['evals'])})")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
