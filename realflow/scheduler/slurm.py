"""Slurm launcher: one job per run, every process an ``srun`` step of it.

``start(requests)`` plans where each process goes (:mod:`realflow.scheduler.slurm_plan`:
node slots, one job component per distinct node shape, so a heterogeneous job when the
nodes' loads differ), submits ONE job whose batch script only holds the allocation,
waits until it runs (``slurm.submit_timeout_s``; the timeout names the job and why it
pends), then starts every process as ``srun --jobid=J [--het-group=K] --nodelist=NODE
-N1 -n1 --cpus-per-task=C --job-name=NAME ...``. One job, not one per process, because
a run needs all its processes at once: a job per worker could start half of them and
leave the rest queued behind other users' jobs.

The ``srun`` clients run on this host as children of the launcher, through
:class:`~realflow.scheduler.local.LocalScheduler`'s machinery: each worker's output lands
in ``<log_dir>/<name>.log`` (srun forwards it), the console tail, ``WorkerFailed`` with
the last log lines, and no orphan ``srun`` when the launcher dies. What a local scheduler
cannot reach is the job itself, so on top of that:

* ``stop_all`` / ``close`` / Ctrl-C / a failed worker: ``scancel --signal=TERM`` to the
  steps (srun would kill them outright), SIGTERM/SIGKILL to the srun clients after
  ``grace``, then ``scancel`` the job and wait until it has left ``squeue``.
* The launcher killed (even SIGKILL): a watchdog process (``_slurm_watchdog.py``, own
  session, reads a pipe from the launcher) sees the pipe close and cancels the job.
  Not covered: a SIGKILL in the milliseconds between sbatch accepting the job and
  the launcher reading its id; the job then holds its nodes until ``slurm.time_limit``.
* srun reports a task killed by signal S as exit 128+S; ``poll`` turns that back into
  -S like a local process, so the launcher tells faults (killed) from errors.

Every Slurm command has a timeout and an error naming the command and Slurm's message
(:mod:`realflow.scheduler.slurm_cli`); a job Slurm refuses names the config field.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence, TextIO

from realflow.base.logging import get_logger
from realflow.base.timeutil import Deadline, format_seconds
from realflow.scheduler import slurm_cli
from realflow.scheduler.base import WorkerRequest
from realflow.scheduler.local import LocalScheduler, _sigint_deferred
from realflow.scheduler.slurm_cli import ComponentState, SlurmError
from realflow.scheduler.slurm_plan import JobPlan, PlanError, plan_job

logger = get_logger("realflow.scheduler.slurm")

_WATCHDOG = Path(__file__).with_name("_slurm_watchdog.py")
CANCEL_TIMEOUT = 60.0  # seconds for a cancelled job to leave squeue
#: a job pending for one of these reasons will never start: fail now, not after submit_timeout_s
_HOPELESS = {"PartitionConfig": "partition", "PartitionNodeLimit": "nodelist", "PartitionTimeLimit": "time_limit",
             "BadConstraints": "", "InvalidAccount": "account", "InvalidQOS": ""}
#: words of Slurm's refusal -> the config field behind it
_BLAME = (("partition", "partition"), ("account", "account"), ("time limit", "time_limit"),
          ("node name", "nodelist"), ("nodelist", "nodelist"), ("memory", "mem_per_worker_mb"),
          ("gres", "gpus_per_node"), ("gpu", "gpus_per_node"), ("node configuration", "cpus_per_worker"))
_HOLD_SCRIPT = """#!/bin/sh
# realflow: holds the allocation; the launcher runs every process as an srun step of this job.
while :; do sleep 3600; done
"""


def _srun_exit(rc: int | None) -> int | None:
    """srun's exit code -> a local process's: 128+S (task killed by signal S) -> -S."""
    return -(rc - 128) if rc is not None and 128 < rc < 128 + 65 else rc


class SlurmScheduler(LocalScheduler):
    """Runs a run's processes as steps of one Slurm job (see module docstring)."""

    def __init__(self, log_dir: str | os.PathLike, slurm_cfg: Any, job_name: str = "realflow",
                 console: bool = True, console_stream: TextIO | None = None, grace: float = 5.0,
                 tail_lines: int = 20) -> None:
        super().__init__(log_dir, console=console, console_stream=console_stream, grace=grace,
                         tail_lines=tail_lines)
        self.cfg = slurm_cfg
        self.job_name = job_name
        self.job_id: str | None = None
        self.plan: JobPlan | None = None
        self._node_of: dict[str, str] = {}
        self._watchdog: subprocess.Popen | None = None
        self._job_ended = False

    # ---- starting -------------------------------------------------------------------
    def submit(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
               n_threads: int = 1, cwd: str | os.PathLike | None = None, *, service: bool = False,
               expendable: bool = False, restarts: int = 0) -> int:
        raise RuntimeError("SlurmScheduler runs a whole run as one Slurm job: pass every process to "
                           "start(requests) at once")

    def start(self, requests: Sequence[WorkerRequest]) -> None:
        """Plan, submit and wait for the job, then start every process as a step of it."""
        if self.job_id is not None or self._closed:
            raise RuntimeError("SlurmScheduler.start runs once (one job per scheduler)")
        slurm_cli.require_tools()
        names = [r.name for r in requests]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"worker name(s) {', '.join(dup)} submitted twice")
        try:
            self.plan = plan_job(requests, self.cfg, slurm_cli.nodes(), slurm_cli.expand_hostlist(self.cfg.nodelist))
        except PlanError as e:
            raise SlurmError(str(e)) from None
        self._start_watchdog()
        try:
            self.job_id = self._submit()
            self._tell_watchdog(f"+ {self.job_id}")
            states = self._wait_running(self.job_id)
            self._node_of = self._place(states)
            for r in requests:
                node = self._node_of[r.name]
                argv = self.plan.srun_args(r.name, self.job_id, node) + list(r.argv)
                LocalScheduler.submit(self, r.name, argv, env=r.env, n_threads=r.n_threads, service=r.service,
                                      expendable=r.expendable, restarts=r.restarts)
                logger.info("%s runs on node %s (Slurm job %s)", r.name, node, self.job_id)
        except BaseException:
            self.stop_all()  # cancels the job, pending or running
            raise

    def _submit(self) -> str:
        assert self.plan is not None
        try:
            job = slurm_cli.submit(self.plan.sbatch_args(self.cfg, self.job_name), _HOLD_SCRIPT)
        except SlurmError as e:
            raise SlurmError(f"Slurm refused the job ({self._blame(str(e))}): {e}") from None
        kind = f"heterogeneous, {len(self.plan.components)} components" if self.plan.het else "1 component"
        logger.info("submitted Slurm job %s (%s, %s):\n%s", job, self.job_name, kind, self.plan.describe())
        return job

    def _blame(self, message: str) -> str:
        """The config fields Slurm's message points at (all set ones if it points nowhere)."""
        low = message.lower()
        fields = [f for word, f in _BLAME if word in low]
        if not fields:
            fields = [f for f in ("partition", "account", "time_limit", "nodelist", "gpus_per_node",
                                  "cpus_per_worker", "mem_per_worker_mb") if getattr(self.cfg, f)]
        seen = dict.fromkeys(fields)
        return ", ".join(f"slurm.{f}={getattr(self.cfg, f)!r}" for f in seen) or "default slurm.* settings"

    def _wait_running(self, job: str) -> list[ComponentState]:
        assert self.plan is not None
        timeout = float(self.cfg.submit_timeout_s)
        deadline = Deadline(timeout)
        told = False
        while True:
            states = slurm_cli.job_state(job)
            if not states:
                raise SlurmError(f"Slurm job {job} ({self.job_name}) left the queue before it started "
                                 f"(see `scontrol show job {job}`)")
            if len(states) == len(self.plan.components) and all(s.state == "RUNNING" for s in states):
                return states
            ended = [s for s in states if s.state not in slurm_cli.LIVE_STATES]
            if ended:
                raise SlurmError(f"Slurm job {job} ended before it started: " + _summary(states))
            stuck = [s for s in states if s.state == "PENDING" and s.reason in _HOPELESS]
            if stuck:
                field = _HOPELESS[stuck[0].reason]
                where = f"slurm.{field}={getattr(self.cfg, field)!r}: " if field and getattr(self.cfg, field) else ""
                raise SlurmError(f"{where}Slurm job {job} cannot start: {_summary(states)} (cancelled it)")
            if deadline.expired():
                raise TimeoutError(f"Slurm job {job} ({self.job_name}) did not start within "
                                   f"{format_seconds(timeout)} (slurm.submit_timeout_s): {_summary(states)}; "
                                   "cancelled it")
            if not told and deadline.elapsed() > 2.0:
                logger.info("waiting for Slurm job %s to start: %s", job, _summary(states))
                told = True
            deadline.sleep(0.25)

    def _place(self, states: list[ComponentState]) -> dict[str, str]:
        """Process name -> node, from the nodes Slurm gave each component."""
        assert self.plan is not None
        node_of_slot: dict[int, str] = {}
        for comp, st in zip(self.plan.components, states):
            got = slurm_cli.expand_hostlist(st.nodelist)
            nodes = comp.nodelist or sorted(got)
            if len(nodes) != len(comp.slots) or not set(nodes) <= set(got):
                raise SlurmError(f"Slurm job {self.job_id} component {st.offset} got nodes {st.nodelist}, "
                                 f"expected {len(comp.slots)} node(s) {', '.join(comp.nodelist)}")
            node_of_slot.update(zip(comp.slots, nodes))
        return {name: node_of_slot[slot] for name, slot in self.plan.slot_of.items()}

    def node(self, name: str) -> str:
        """The node worker ``name`` runs on."""
        self.pid(name)  # names the culprit if unknown
        return self._node_of[name]

    # ---- watching -------------------------------------------------------------------
    def poll(self) -> dict[str, int | None]:
        """``{name: returncode or None}``; a task killed by signal S reads -S (srun says 128+S)."""
        for w in self._workers.values():
            if w.returncode is None:
                w.returncode = _srun_exit(w.popen.poll())
        return {w.name: w.returncode for w in self._workers.values()}

    # ---- stopping -------------------------------------------------------------------
    def stop_all(self, grace: float | None = None) -> None:
        """SIGTERM the steps through Slurm, stop the srun clients, then cancel the job."""
        grace = self.grace if grace is None else grace
        with self._lock, _sigint_deferred():
            if self.job_id is not None and not self._job_ended and self.running():
                try:
                    slurm_cli.cancel(self.job_id, signal="TERM")  # to the steps' tasks, not the job
                except SlurmError as e:
                    logger.warning("could not signal the steps of Slurm job %s: %s", self.job_id, e)
                deadline = Deadline(grace)
                while self.running() and not deadline.expired():
                    deadline.sleep(0.1)
            super().stop_all(grace)
            self._cancel_job()

    def _cancel_job(self) -> None:
        job = self.job_id
        if job is None or self._job_ended:
            return
        try:
            slurm_cli.cancel(job)
            deadline = Deadline(CANCEL_TIMEOUT)
            while slurm_cli.job_alive(job):
                if deadline.expired():
                    logger.error("Slurm job %s is still in squeue %s after scancel: %s", job,
                                 format_seconds(CANCEL_TIMEOUT), _summary(slurm_cli.job_state(job)))
                    return
                deadline.sleep(0.2)
        except SlurmError as e:
            logger.error("could not cancel Slurm job %s (the watchdog retries when the launcher exits): %s", job, e)
            return
        self._job_ended = True
        self._tell_watchdog(f"- {job}")
        logger.info("Slurm job %s cancelled", job)

    def close(self) -> None:
        """Stop everything, cancel the job, end the watchdog and the console. Idempotent."""
        if self._closed:
            return
        super().close()  # stop_all (cancels the job), the process reaper, the console
        if self._watchdog is not None:
            if self._watchdog.stdin is not None:
                self._watchdog.stdin.close()  # EOF: it cancels what is still registered and exits
            try:
                self._watchdog.wait(timeout=CANCEL_TIMEOUT)
            except subprocess.TimeoutExpired:
                self._watchdog.kill()

    # ---- the job watchdog ---------------------------------------------------------------
    def _start_watchdog(self) -> None:
        if self._watchdog is None:
            with open(self.log_dir / "slurm_watchdog.log", "ab") as log:
                self._watchdog = subprocess.Popen(
                    [sys.executable, "-I", "-S", str(_WATCHDOG)], stdin=subprocess.PIPE, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True, env=slurm_cli.clean_env())

    def _tell_watchdog(self, line: str) -> None:
        if self._watchdog is not None and self._watchdog.stdin is not None:
            try:
                self._watchdog.stdin.write((line + "\n").encode())
                self._watchdog.stdin.flush()
            except (BrokenPipeError, ValueError):
                logger.warning("Slurm job watchdog (pid %d) is gone", self._watchdog.pid)


def _summary(states: list[ComponentState]) -> str:
    parts = [f"{s.state.lower()}" + (f" ({s.reason})" if s.reason not in ("None", "") else "") for s in states]
    if len(parts) == 1:
        return parts[0]
    return ", ".join(f"component {s.offset} {p}" for s, p in zip(states, parts))
