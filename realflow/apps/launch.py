"""Shared command line of every ``realflow.apps.main_*`` entry point.

    python -m realflow.apps.main_sft [--config FILE ...] [key=value ...] [--import MOD]
                                     [--check | --dry-run | --print-config] [--console] [--help]

Resolves the config (defaults, then ``--config`` files in order, then ``key=value``
overrides) and checks it (bad keys and graphs fail here, in one line), prepares the
experiment once (data, tokenizer, initial weights), checks data rows and checkpoints
against the plan (:mod:`realflow.system.preflight`), writes the resolved config to
``<run dir>/config.yaml``, then starts the master and the model workers as separate
processes through the local scheduler (each reads that file, so every process of the run
has the same config) and renders the master's progress records on the console.
``--print-config`` prints the resolved config and stops; ``--dry-run`` stops after the plan
(drawn, nothing prepared); ``--check`` runs every check, data tokenisation included, but
prepares nothing (no SFT start trained, no data generated, nothing downloaded or written):
what ``prepare()`` would make is listed as not checked.  An experiment may add opt-in checks
(its ``extra_checks(setup, pending)``; the RL ones: ``check.mismatch=true`` generates a few
samples in-process and prints the generator-trainer log-prob gap).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from typing import Optional

from realflow.api.experiment import experiment_registry
from realflow.apps.worker import role_command
from realflow.config.cli import ConfigError, format_help, parse_overrides
from realflow.config.files import dump_config, experiment_of, write_config
from realflow.data.dataset import DataRowError
from realflow.plugins import load_plugins
from realflow.base import names
from realflow.base.output_paths import check_tree_inside, output_root
from realflow.base.wandb_sink import check_installed
from realflow.comm import shm
from realflow.comm.auth import SECRET_FILE_ENV, new_secret, write_secret_file
from realflow.system.plan import compile_plan
from realflow.system.preflight import PreflightError, preflight
from realflow.system.progress import ProgressFollower

USAGE = ("usage: python -m realflow.apps.{app} [--config FILE ...] [key=value ...] [--import MODULE ...] "
         "[--check | --dry-run | --print-config] [--console] [--help]")
#: the launcher's options, as (flag, what it does): the options block of every experiment's --help
OPTIONS: tuple[tuple[str, str], ...] = (
    ("--config FILE", "YAML or JSON config (nested or dotted keys; `experiment: NAME` picks the experiment);"
                      "\nrepeatable: later files win, key=value items win over files"),
    ("--import MODULE", "import a plugin module first: your experiments, graphs, interfaces (repeatable)"),
    ("--check", "run every check (config, plan, data, checkpoints, placement); start nothing"),
    ("--dry-run", "print the plan and draw it to <run dir>/plan.png; prepare and start nothing"),
    ("--print-config", "print the resolved config as YAML (a run saves it as <run dir>/config.yaml) and exit"),
    ("--console", "every process's log lines on this console instead of the progress bar"),
    ("-h, --help", "this text"),
)
MODES = ("dry-run", "check", "print-config")
#: the resolved config, in the run directory: what every process of the run reads
CONFIG_FILE = "config.yaml"


class UsageError(Exception):
    pass


@dataclasses.dataclass
class CommandLine:
    """The launcher's arguments, sorted: options apart, ``key=value`` overrides in their order."""

    imports: list[str] = dataclasses.field(default_factory=list)
    overrides: list[str] = dataclasses.field(default_factory=list)
    configs: list[str] = dataclasses.field(default_factory=list)
    mode: Optional[str] = None  # one of MODES, or None: run
    show_help: bool = False
    experiment: Optional[str] = None  # experiment=NAME
    console: bool = False


def _split_args(argv: list[str]) -> CommandLine:
    args = CommandLine()
    it = iter(argv)
    for a in it:
        if a in ("-h", "--help"):
            args.show_help = True
        elif a in ("--console",):
            args.console = True
        elif a.startswith("--") and a[2:] in MODES:
            if args.mode not in (None, a[2:]):
                raise UsageError(f"--{args.mode} and {a} exclude each other")
            args.mode = a[2:]
        elif a in ("--import", "--config"):
            value = next(it, None)
            if value is None or value.startswith("-"):
                what = "a module name" if a == "--import" else "a file (e.g. --config run.yaml)"
                raise UsageError(f"{a} needs {what}")
            (args.imports if a == "--import" else args.configs).append(value)
        elif a.startswith(("--import=", "--config=")):
            (args.imports if a.startswith("--import=") else args.configs).append(a.split("=", 1)[1])
        elif a.startswith("experiment="):
            args.experiment = a.split("=", 1)[1]
        elif a.startswith("-"):
            raise UsageError(f"unknown option '{a}'" + _did_you_mean(a))
        else:
            args.overrides.append(a)
    return args


def _did_you_mean(option: str) -> str:
    from realflow.api.registry import closest

    known = [flag.split()[0] for flag, _ in OPTIONS] + ["-h"]
    hint = closest(option.split("=", 1)[0], known)
    return f"; did you mean {', '.join(hint)}?" if hint else f" (options: {', '.join(known)})"


def page(text: str) -> int:
    """Print ``text`` (help, a config) to stdout; a reader that stops early (``| head``) is no error. 0."""
    try:
        print(text, flush=True)
    except BrokenPipeError:  # silence the flush at exit too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def main(experiment: Optional[str], argv: Optional[list[str]] = None, app: str = "main") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _split_args(argv)
        imports, mode, console = args.imports, args.mode, args.console
        load_plugins(imports)
        named = None if args.experiment else experiment_of(args.configs)  # (name, file:line) or None
        experiment = args.experiment or (named[0] if named else experiment)
        if experiment is None:
            raise UsageError(f"name the experiment: experiment=NAME, or `experiment: NAME` in a --config file "
                             f"(known: {', '.join(experiment_registry.names())})")
        try:
            cls = experiment_registry.get(experiment)
        except KeyError as e:  # a file named it: say where
            raise UsageError(f"{named[1]}: {e}" if named else str(e)) from None
        if args.show_help:
            return page(format_help(cls, usage=USAGE.format(app=app), options=OPTIONS))
        overrides = [f"--config={f}" for f in args.configs] + args.overrides  # files first, key=value on top
        cfg = parse_overrides(cls, overrides)
        setup = cfg.setup()
        # nothing is written yet: a symlink in an existing run directory that leads out is refused here
        check_tree_inside(setup.run_dir, output_root(setup.run_dir))
        if setup.allocation == "auto":  # the workers get the choice, not the search
            from realflow.planner.auto import choose_allocation

            chosen, why = choose_allocation(setup)
            print(why, file=sys.stderr if mode == "print-config" else sys.stdout, flush=True)
            overrides = [*overrides, f"allocation={chosen}"]
            cfg = parse_overrides(cls, overrides)
            setup = cfg.setup()
        resolved = dump_config(cfg, experiment)  # as parsed: what prepare() may do to cfg is not the user's config
        if mode == "print-config":
            return page(resolved.rstrip("\n"))
        plan = compile_plan(setup)
        plan.graph.check_references(roles=setup.models)  # interfaces registered (plugins are imported by now)
        check_installed(setup.wandb)  # here, not in the master: a missing optional package is a usage error
    except (UsageError, ConfigError, KeyError, ValueError, ImportError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"error: {msg}", file=sys.stderr)
        return 2
    if mode == "dry-run":
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
        if mode == "check":  # --check never trains or downloads (generates only if check.* asks): prepare() is skipped
            _check_creatable(setup.run_dir)
            notes = preflight(setup, pending=cfg.pending_paths())
            extra = getattr(cfg, "extra_checks", None)  # an experiment's opt-in checks (e.g. check.mismatch)
            if callable(extra):
                notes += extra(setup, cfg.pending_paths())
        else:
            cfg.prepare()
            notes = preflight(setup)
            compile_plan(setup)  # again: layouts are checked against checkpoints that prepare() just made
    except (PreflightError, DataRowError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. an unwritable fileroot, a missing data file
        fileroot = setup.run_dir.rsplit("/", 2)[0]
        where = f": {e.filename}" if e.filename else ""
        which = f" (fileroot={fileroot})" if str(e.filename or "").startswith(fileroot) else ""
        print(f"error: cannot prepare the run{which}: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    if mode == "check":
        for note in notes:
            print(f"  {note}")
        print(f"ok: {experiment}: config, data (rows and lengths), checkpoints and the placement of "
              f"{setup.n_workers} worker(s) checked; nothing started")
        return 0
    try:  # every process of the run reads this file: one config for the run and its relaunches
        config_path = write_config(os.path.join(setup.run_dir, CONFIG_FILE), resolved)
    except OSError as e:
        print(f"error: cannot write the run's config to {setup.run_dir}: {e.strerror or e}", file=sys.stderr)
        return 2
    return launch(experiment, imports, [f"--config={config_path}"], setup, merged_console=console)


def _check_creatable(run_dir: str) -> None:
    """The run directory can be made (as ``--check`` must leave nothing behind: a directory made in
    its nearest existing parent and removed at once); OSError names the parent otherwise."""
    import tempfile

    parent = run_dir
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".realflow-check-", dir=parent))
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror} (cannot create directories in {parent})", run_dir) from None


def launch(experiment: str, imports: list[str], overrides: list[str], setup, merged_console: bool = False) -> int:
    """Run the experiment's processes through its launcher until the master finishes.

    With ``recover_mode=auto`` a fault (a worker killed or lost, not an error in the
    experiment's own code) tears the job down and relaunches it, up to ``recover_retries``
    times; the master of the new attempt resumes from the last recover point.
    """
    from realflow.apps.plot import plot_after_run
    from realflow.base.name_resolve import NameResolveError, make_name_resolver
    from realflow.system.recover import RecoverError, RecoverPoints

    os.makedirs(setup.run_dir, exist_ok=True)
    points = RecoverPoints(setup)
    try:
        point = points.resume_point()
    except RecoverError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        resolver = make_name_resolver(setup.name_resolve_config())
        resolver.get_subtree(names.trial_root(setup.experiment_name, setup.trial_name))  # reachable?
    except NameResolveError as e:
        conf = setup.name_resolve_config()
        print(f"error: name_resolve (type={conf.get('type', 'file')}): {e}".splitlines()[0], file=sys.stderr)
        return 2
    if point is not None:
        print(f"resuming from the recover point of step {point.step}: {point.path} "
              "(recover_mode=off starts from scratch)", flush=True)
    try:
        attempt = 0
        while True:
            rc, fault = _run_attempt(experiment, imports, overrides, setup, merged_console, attempt, resolver)
            if rc == 0 or fault is None:
                if rc != 130:  # finished or failed for good, not interrupted: draw its curves
                    plot_after_run(setup.run_dir)
                return rc
            retries = setup.recover.retries
            if setup.recover.mode != "auto" or attempt >= retries:
                why = (f"giving up after {retries} relaunches (recover_retries={retries})"
                       if setup.recover.mode == "auto" else f"recover_mode={setup.recover.mode}: no automatic relaunch")
                print(f"fault: {fault}; {why}", file=sys.stderr)
                plot_after_run(setup.run_dir)  # the curves up to the fault help to see what went wrong
                return rc
            attempt += 1
            latest = points.latest()
            where = f"recover point of step {latest.step}" if latest else "the start (no recover point yet)"
            print(f"fault: {fault}; relaunching ({attempt}/{retries}) from {where}", file=sys.stderr, flush=True)
    finally:
        resolver.close()


def _run_attempt(experiment: str, imports: list[str], overrides: list[str], setup, merged_console: bool,
                 attempt: int, resolver) -> tuple[int, Optional[str]]:
    """One launch of every process; returns (exit code, the fault that ended it or None)."""
    from realflow.scheduler import SchedulerError, make_scheduler

    for stale in ("progress.jsonl", "trace"):
        path = os.path.join(setup.run_dir, stale)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    resolver.clear_subtree(  # a dead attempt's names must not be found
        names.trial_root(setup.experiment_name, setup.trial_name))
    log_dir = os.path.join(setup.run_dir, "logs" if attempt == 0 else f"logs/retry{attempt}")
    requests = worker_requests(experiment, imports, overrides, setup)
    sched = make_scheduler(setup.deploy, log_dir, merged_console,
                           job_name=f"realflow:{setup.experiment_name}:{setup.trial_name}")
    print(f"run directory: {setup.run_dir}  (logs: {log_dir})", flush=True)
    try:
        try:
            sched.start(requests)
        except SchedulerError as e:  # the cluster refused the job or could not place it: one line, no retry
            print(f"error: {e}", file=sys.stderr)
            return 2, None
        view = ConsoleView(setup.run_dir)
        return _follow(sched, view, setup)
    finally:
        sched.close()
        # segments a dead consumer never mapped would otherwise outlive the run; only those of
        # dead producers: another run of the same experiment and trial name on this host (another
        # file root) keeps its live ones
        shm.cleanup_segments(shm.segment_prefix(setup.experiment_name, setup.trial_name), only_dead_producers=True)
        if os.path.exists(os.path.join(setup.run_dir, ".secret")):
            os.remove(os.path.join(setup.run_dir, ".secret"))
        resolver.clear_subtree(names.trial_root(setup.experiment_name, setup.trial_name))


def worker_requests(experiment: str, imports: list[str], overrides: list[str], setup) -> list:
    """Every process of the run: master, model workers and, for asynchronous runs, the
    generation servers (expendable: the controller fails over, and the launcher starts a
    replacement that rejoins it), the rollout controller and
    the rollout workers (services: stopped once the master is done)."""
    from realflow.scheduler import WorkerRequest

    # the secret travels as a path to a 0600 file: every child's environment holds only that
    env = {SECRET_FILE_ENV: write_secret_file(os.path.join(setup.run_dir, ".secret"), new_secret())}
    if setup.deploy.cluster:  # bind and advertise the node's address, not loopback
        env["REALFLOW_CLUSTER"] = "1"

    def argv(role: str, i: int) -> list[str]:
        return role_command(role, i, experiment, imports, overrides)

    d = setup.deploy
    on_gpus = (d.launcher == "slurm" and d.slurm.gpus_per_node > 0) or (d.launcher == "ray" and d.ray.gpus_per_worker > 0)
    reqs = [WorkerRequest("master", argv("master", 0), env, n_threads=1, kind="master")]
    for i in range(setup.n_workers):
        reqs.append(WorkerRequest(f"model_worker/{i}", argv("model_worker", i), env, n_threads=setup.worker_threads,
                                  kind="model_worker", gpus=1 if on_gpus else 0))
    spec = setup.rollout
    # a dead generation server is replaced in place (it rejoins the controller) when the run recovers
    server_restarts = setup.recover.retries if setup.recover.mode == "auto" else 0
    if spec is not None:
        for i in range(spec.n_servers):
            reqs.append(WorkerRequest(f"gen_server/{i}", argv("gen_server", i), env,
                                      n_threads=spec.server_tp * setup.worker_threads, kind="gen_server",
                                      gpus=spec.server_tp if on_gpus else 0,
                                      expendable=True, restarts=server_restarts))
        reqs.append(WorkerRequest("rollout_controller", argv("rollout_controller", 0), env, n_threads=1,
                                  kind="rollout", service=True))
        for i in range(spec.n_rollout_workers):
            reqs.append(WorkerRequest(f"rollout_worker/{i}", argv("rollout_worker", i), env, n_threads=1,
                                      kind="rollout", service=True))
    return reqs


def _follow(sched, view: "ConsoleView", setup) -> tuple[int, Optional[str]]:
    """Follow the run until it ends: (exit code, the fault that ended it, if it was one).

    A fault is something a relaunch can fix: a worker killed by a signal or declared lost
    by the master. An error raised by the experiment's own code would happen again, so it
    is not one.
    """
    from realflow.scheduler.local import WorkerFailed, describe_exit

    try:
        while not sched.wait(timeout=0.5):
            view.refresh()
        view.refresh()
    except WorkerFailed as e:
        view.refresh()
        view.close()
        killed = {n: rc for n, rc in e.returncodes.items() if rc < 0}
        if view.follower.summary is not None:  # the master had finished: the results are complete
            lost = "; ".join(f"worker '{n}' {describe_exit(rc)}" for n, rc in e.returncodes.items())
            print(f"warning: {lost} after the run finished; nothing to relaunch", file=sys.stderr)
            _print_summary(view.follower.summary, setup.run_dir)
            return 0, None
        fault = None
        if killed:
            fault = "; ".join(f"worker '{n}' {describe_exit(rc)}" for n, rc in killed.items())
        elif view.follower.error and view.follower.error_is_fault:
            fault = view.follower.error
        if view.follower.error:  # the master named the culprit; the log tail has the details
            print(f"error: {view.follower.error}", file=sys.stderr)
            print(f"(details: {e.log_path})", file=sys.stderr)
        else:
            print(f"error: {e}", file=sys.stderr)
        return 1, fault
    except KeyboardInterrupt:
        view.close()
        print("interrupted: stopping all processes", file=sys.stderr)
        sched.stop_all()
        return 130, None
    view.close()
    _print_summary(view.follower.summary, setup.run_dir)
    return (0 if view.follower.summary is not None else 1), None


_SHOWN = ("/loss", "/lr", "/grad_norm", "/reward", "/accuracy")
# asynchronous runs: weight version, staleness, buffer and throughput
_ASYNC_SHOWN = {"async/version": "v", "async/offpolicy_head_max": "stale", "async/buffer_size": "buf",
                "async/trained_samples_per_s": "samples/s", "async/gen_tokens_per_s": "gen_tok/s"}


def progress_fields(stats: dict) -> dict[str, str]:
    """The live progress line: losses, rewards and learning rates, then seconds per MFC."""
    shown = {k.replace("_train/", "/").replace("/", ":", 1) if k.count("/") else k: f"{v:.3g}"
             for k, v in stats.items() if k.endswith(_SHOWN)}
    shown.update({short: f"{stats[k]:.3g}" for k, short in _ASYNC_SHOWN.items() if k in stats})
    if stats.get("nonfinite_skipped_steps"):
        shown["skipped"] = f"{int(stats['nonfinite_skipped_steps'])}"
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
    "sampled_accuracy": "  (pass@1: mean exact match, or eval reward, of samples at the policy's temperature)",
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
