"""Shared by the step benchmarks: run a realflow job and break its step time down.

Per MFC the master records the wall time of the MFC's topological generation and the
time its pre/post hooks took on the slowest participant; MFCs of one generation run
concurrently, so they share that generation's time.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_job(experiment: str, fileroot: str, trial: str, steps: int, overrides: list[str],
            timeout_s: float = 3600) -> list[dict]:
    """Run ``experiment`` for ``steps`` steps through the launcher; its stats rows with a step time."""
    cmd = [sys.executable, "-m", "realflow.apps.main", f"experiment={experiment}", f"fileroot={fileroot}",
           f"max_train_steps={steps}", f"trial_name={trial}", "trace=false", "recover_mode=off", *overrides]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if res.returncode != 0:
        sys.exit(f"run failed ({res.returncode}): {' '.join(cmd)}\n{res.stderr[-3000:]}")
    with open(os.path.join(fileroot, experiment, trial, "stats.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if "time/step" in r]


def breakdown(rows: list[dict]) -> dict[str, float]:
    """Mean seconds per step of each phase; ``step`` is the whole step."""
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
    parts = {"generation": gen, "reallocation": realloc, "inference": infer, "training": train,
             "other hooks (offload/reload/EMA)": other_hooks}
    parts["orchestration (dispatch, data movement, rest)"] = step - sum(parts.values())
    parts["step"] = step
    return parts
