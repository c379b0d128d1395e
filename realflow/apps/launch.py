"""Shared command line of every ``realflow.apps.main_*`` entry point.

    python -m realflow.apps.main_sft [key=value ...] [--import MOD] [--dry-run] [--help]

Parses and checks the config (bad keys and graphs fail here, in one line), prepares
the experiment once (data, tokenizer, initial weights), then starts the master and
the model workers as separate processes through the local scheduler and renders the
master's progress records on the console.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Optional

from realflow.api.config import ConfigError, format_help, import_modules, parse_overrides
from realflow.api.experiment import experiment_registry
from realflow.comm import shm
from realflow.comm.auth import new_secret
from realflow.system.plan import compile_plan
from realflow.system.preflight import PreflightError, preflight
from realflow.system.progress import ProgressFollower

BUILTIN_MODULES = ["experiments"]
USAGE = "usage: python -m realflow.apps.{app} [key=value ...] [--import MODULE] [--dry-run] [--console] [--help]"


class UsageError(Exception):
    pass


def _split_args(argv: list[str]) -> tuple[list[str], list[str], bool, bool, Optional[str]]:
    imports, overrides = [], []
    dry_run = show_help = False
    experiment = None
    it = iter(argv)
    for a in it:
        if a in ("-h", "--help"):
            show_help = True
        elif a == "--dry-run":
            dry_run = True
        elif a == "--import":
            mod = next(it, None)
            if mod is None:
                raise UsageError("--import needs a module name")
            imports.append(mod)
        elif a.startswith("--import="):
            imports.append(a.split("=", 1)[1])
        elif a.startswith("experiment="):
            experiment = a.split("=", 1)[1]
        elif a.startswith("-"):
            raise UsageError(f"unknown option '{a}'")
        else:
            overrides.append(a)
    return imports, overrides, dry_run, show_help, experiment


def main(experiment: Optional[str], argv: Optional[list[str]] = None, app: str = "main") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        console = "--console" in argv
        argv = [a for a in argv if a != "--console"]
        imports, overrides, dry_run, show_help, exp_arg = _split_args(argv)
        experiment = exp_arg or experiment
        import_modules(BUILTIN_MODULES + imports)
        if experiment is None:
            raise UsageError(f"name the experiment: experiment=NAME (known: {', '.join(experiment_registry.names())})")
        cls = experiment_registry.get(experiment)
        if show_help:
            print(format_help(cls, prog=f"python -m realflow.apps.{app}"))
            return 0
        cfg = parse_overrides(cls, overrides)
        setup = cfg.setup()
        plan = compile_plan(setup)
    except (UsageError, ConfigError, KeyError, ValueError, ImportError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"error: {msg}", file=sys.stderr)
        return 2
    if dry_run:
        print(plan.describe())
        os.makedirs(setup.run_dir, exist_ok=True)
        png = os.path.join(setup.run_dir, "plan.png")
        plan.draw(png)
        print(f"graph and placement drawn to {png}")
        if setup.rollout is not None:
            from realflow.apps.async_view import describe_rollout, draw_processes

            print(describe_rollout(setup))
            procs = draw_processes(setup, os.path.join(setup.run_dir, "processes.png"))
            print(f"processes and flows drawn to {procs}")
        return 0
    try:
        cfg.prepare()
        preflight(setup)
    except PreflightError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return launch_local(experiment, imports, overrides, setup, merged_console=console)


def launch_local(experiment: str, imports: list[str], overrides: list[str], setup, merged_console: bool = False) -> int:
    """Run master + model workers as local processes until the master finishes."""
    from realflow.scheduler.local import LocalScheduler

    for stale in ("name_resolve", "progress.jsonl", "trace"):
        path = os.path.join(setup.run_dir, stale)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    os.makedirs(setup.run_dir, exist_ok=True)
    log_dir = os.path.join(setup.run_dir, "logs")
    env = {"REALFLOW_SECRET": new_secret().hex()}
    common = ["--experiment", experiment]
    for mod in BUILTIN_MODULES + imports:
        common += ["--import", mod]
    # default console: a progress bar and the master's events; --console: every process's log lines, merged
    sched = LocalScheduler(log_dir, console=merged_console)
    entry = [sys.executable, "-m", "realflow.system.worker_main"]
    print(f"run directory: {setup.run_dir}  (logs: {log_dir})", flush=True)
    sched.submit("master", entry + ["--role", "master"] + common + ["--"] + overrides, env=env, n_threads=1)
    for i in range(setup.n_workers):
        argv = entry + ["--role", "model_worker", "--index", str(i)] + common + ["--"] + overrides
        sched.submit(f"model_worker/{i}", argv, env=env, n_threads=setup.worker_threads)
    if setup.rollout is not None:
        submit_rollout_side(sched, setup, common, overrides, env)
    view = ConsoleView(setup.run_dir)
    try:
        return _follow(sched, view, setup)
    finally:  # segments a dead consumer never mapped would otherwise outlive the run
        shm.cleanup_segments(shm.segment_prefix(setup.experiment_name, setup.trial_name))


def submit_rollout_side(sched, setup, common: list[str], overrides: list[str], env: dict[str, str]) -> None:
    """Generation servers (expendable: the controller fails over), the rollout controller and the
    rollout workers (services: stopped once the master is done) of an asynchronous run."""
    spec = setup.rollout
    entry = [sys.executable, "-m", "realflow.rollout.main"]

    def argv(role: str, i: int) -> list[str]:
        return entry + ["--role", role, "--index", str(i)] + common + ["--"] + overrides

    for i in range(spec.n_servers):
        sched.submit(f"gen_server/{i}", argv("gen_server", i), env=env, n_threads=spec.server_tp * setup.worker_threads,
                     expendable=True)
    sched.submit("rollout_controller", argv("rollout_controller", 0), env=env, n_threads=1, service=True)
    for i in range(spec.n_rollout_workers):
        sched.submit(f"rollout_worker/{i}", argv("rollout_worker", i), env=env, n_threads=1, service=True)


def _follow(sched, view: "ConsoleView", setup) -> int:
    from realflow.scheduler.local import WorkerFailed

    try:
        while not sched.wait(timeout=0.5):
            view.refresh()
        view.refresh()
    except WorkerFailed as e:
        view.refresh()
        view.close()
        if view.follower.error:  # the master named the culprit; the log tail has the details
            print(f"error: {view.follower.error}", file=sys.stderr)
            print(f"(details: {e.log_path})", file=sys.stderr)
        else:
            print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        view.close()
        print("interrupted: stopping all processes", file=sys.stderr)
        sched.stop_all()
        return 130
    view.close()
    _print_summary(view.follower.summary, setup.run_dir)
    return 0 if view.follower.summary is not None else 1


_SHOWN = ("/loss", "/lr", "/grad_norm", "/reward", "/accuracy")
# asynchronous runs: weight version, staleness, buffer and throughput
_ASYNC_SHOWN = {"async/version": "v", "async/offpolicy_head_max": "stale", "async/buffer_size": "buf",
                "async/trained_samples_per_s": "samples/s", "async/gen_tokens_per_s": "gen_tok/s"}


def progress_fields(stats: dict) -> dict[str, str]:
    """The live progress line: losses, rewards and learning rates, then seconds per MFC."""
    shown = {k.replace("_train/", "/").replace("/", ":", 1) if k.count("/") else k: f"{v:.3g}"
             for k, v in stats.items() if k.endswith(_SHOWN)}
    shown.update({short: f"{stats[k]:.3g}" for k, short in _ASYNC_SHOWN.items() if k in stats})
    times = {k[5:]: v for k, v in stats.items() if k.startswith("time/") and k not in ("time/step", "time/fetch")}
    if times:
        shown["s"] = ",".join(f"{k.replace('actor_', '').replace('_inf', '')}={v:.2f}" for k, v in times.items())
    return shown


class ConsoleView:
    """A tqdm bar for steps, plus one line per master event (evaluations, checkpoints)."""

    def __init__(self, run_dir: str):
        self.follower = ProgressFollower(run_dir)
        self.bar = None
        self.t0 = time.time()

    def refresh(self) -> None:
        self.follower.poll(self._on_record)

    def _on_record(self, rec: dict) -> None:
        from tqdm import tqdm

        if rec["kind"] == "start":
            self.bar = tqdm(total=rec["total"], desc="train", unit="step", dynamic_ncols=True)
        elif rec["kind"] == "step" and self.bar is not None:
            self.bar.set_postfix(progress_fields(rec["stats"]), refresh=False)
            self.bar.update(rec["step"] - self.bar.n)
        elif rec["kind"] == "event":
            (self.bar.write if self.bar is not None else print)(rec["message"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


_METRIC_NOTES = {
    "accuracy": "  (greedy decoding)",
    "sampled_accuracy": "  (pass@1: mean exact match of samples at the policy's temperature)",
}


def _print_summary(summary: Optional[dict], run_dir: str) -> None:
    if summary is None:
        print("error: the master ended without a summary; see the logs", file=sys.stderr)
        return
    before, after = summary.get("eval_before"), summary.get("eval_after")
    if before and after:
        for k in sorted(after):
            print(f"held-out {k}: {before.get(k, float('nan')):.4f} -> {after[k]:.4f}"
                  + _METRIC_NOTES.get(k, ""))
    for role, path in (summary.get("checkpoints") or {}).items():
        print(f"saved {role} HF checkpoint: {path}")
    print(f"training time: {summary.get('train_time_s', 0):.1f}s; stats: {os.path.join(run_dir, 'stats.jsonl')}")
