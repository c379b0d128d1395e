"""The Slurm client commands the Slurm launcher uses, each with a timeout and a clear error.

A Slurm controller can be slow or down; a command that hangs would hang the launcher
with no word of why. So every call here has a timeout, and every failure raises
:class:`SlurmError` naming the command line and what Slurm said. Parsing of the
commands' output is kept here too, so that :mod:`realflow.scheduler.slurm` deals in
node names and job states, not in text columns.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from typing import Mapping, Sequence

from realflow.scheduler.base import SchedulerError

TOOLS = ("sbatch", "srun", "squeue", "scancel", "scontrol", "sinfo")
COMMAND_TIMEOUT = 30.0  # seconds for one sbatch/squeue/scancel/scontrol/sinfo call
#: job states in which the job still holds (or will hold) resources
LIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "RESIZING", "REQUEUED",
               "REQUEUE_HOLD", "REQUEUE_FED", "SIGNALING", "STAGE_OUT", "STOPPED")
#: variables of an enclosing job that srun/sbatch would read as options of ours (kept: SLURM_CONF)
_KEEP_VARS = ("SLURM_CONF",)


class SlurmError(SchedulerError):
    """A Slurm command failed, timed out or is missing."""


def require_tools() -> None:
    """Raise if the Slurm client tools are not on PATH."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise SlurmError("launcher=slurm needs the Slurm client tools (salloc/sbatch) on PATH; "
                         f"missing: {', '.join(missing)}")


def clean_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) without the variables of an enclosing Slurm job.

    A launcher started inside an allocation inherits SLURM_NTASKS, SLURM_MEM_PER_NODE, ...;
    sbatch and srun read those as options and would mix them into our job's requests.
    """
    env = dict(os.environ if env is None else env)
    if "SLURM_JOB_ID" not in env and "SLURM_JOBID" not in env:
        return env
    return {k: v for k, v in env.items()
            if not ((k.startswith("SLURM_") and k not in _KEEP_VARS) or k.startswith("SRUN_"))}


def run(argv: Sequence[str], *, input: str | None = None, timeout: float = COMMAND_TIMEOUT,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run a Slurm command; on failure raise SlurmError with the command and Slurm's message."""
    cmd = shlex.join(argv)
    try:
        res = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout,
                             env=clean_env())
    except FileNotFoundError:
        raise SlurmError(f"`{cmd}`: {argv[0]} not found; launcher=slurm needs the Slurm client tools "
                         "(salloc/sbatch) on PATH") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{cmd}` did not answer within {timeout:.0f}s (is slurmctld up? "
                         "try `scontrol ping`)") from None
    if check and res.returncode != 0:
        raise SlurmError(f"`{cmd}` failed (exit {res.returncode}): {slurm_message(res)}")
    return res


def slurm_message(res: subprocess.CompletedProcess) -> str:
    """Slurm's own words from a failed command's stderr (its 'error:' lines if any)."""
    lines = [ln.strip() for ln in (res.stderr or "").splitlines() if ln.strip()]
    errors = [ln.split("error:", 1)[1].strip() for ln in lines if "error:" in ln]
    return "; ".join(errors or lines) or "(no message)"


@dataclass(frozen=True)
class NodeInfo:
    """A node of the cluster as ``sinfo`` sees it."""

    name: str
    cpus: int
    mem_mb: int
    partitions: tuple[str, ...]
    default_partition: bool  # is in the cluster's default partition
    state: str


def nodes() -> list[NodeInfo]:
    """Every node with its CPUs, memory and partitions (one ``sinfo`` call)."""
    out = run(["sinfo", "-h", "-N", "-o", "%N|%c|%m|%P|%T"]).stdout
    by_name: dict[str, dict] = {}
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 5:
            continue
        name, cpus, mem, part, state = parts
        n = by_name.setdefault(name, {"cpus": _int(cpus), "mem": _int(mem), "parts": [], "default": False,
                                      "state": state})
        n["parts"].append(part.rstrip("*"))
        n["default"] = n["default"] or part.endswith("*")
    return [NodeInfo(k, v["cpus"], v["mem"], tuple(v["parts"]), v["default"], v["state"])
            for k, v in by_name.items()]


def _int(text: str) -> int:
    try:
        return int(text.rstrip("+"))
    except ValueError:
        return 0


def expand_hostlist(expr: str) -> list[str]:
    """'n[1-3],m1' -> ['n1', 'n2', 'n3', 'm1'] (Slurm's own expansion)."""
    if not expr:
        return []
    return run(["scontrol", "show", "hostnames", expr]).stdout.split()


def submit(args: Sequence[str], script: str, timeout: float = COMMAND_TIMEOUT) -> str:
    """``sbatch --parsable ARGS`` with the batch script on stdin; returns the job id."""
    res = run(["sbatch", "--parsable", *args], input=script, timeout=timeout)
    job = res.stdout.strip().split(";")[0]
    if not job.isdigit():
        raise SlurmError(f"`sbatch --parsable ...` printed {res.stdout.strip()!r}, not a job id")
    return job


@dataclass(frozen=True)
class ComponentState:
    """One component of a job (the whole job when it is not heterogeneous)."""

    offset: int  # het job offset, 0 for a plain job
    job_id: str  # the component's own job id (the job's id + offset); its steps are listed under it
    state: str  # PENDING, RUNNING, ...
    reason: str  # why it pends ('None' when running)
    nodelist: str  # Slurm hostlist expression, '' while pending


def job_state(job: str) -> list[ComponentState]:
    """The job's components as ``squeue`` lists them; [] once the job has left the queue."""
    res = run(["squeue", "-h", "-j", job, "-o", "%i|%A|%T|%r|%N"], check=False)
    if res.returncode != 0:
        if "Invalid job id" in (res.stderr or ""):
            return []
        raise SlurmError(f"`squeue -j {job}` failed (exit {res.returncode}): {slurm_message(res)}")
    out = []
    for line in res.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 5:
            continue
        jid, own_id, state, reason, nodelist = parts
        offset = int(jid.split("+", 1)[1]) if "+" in jid else 0
        out.append(ComponentState(offset, own_id, state, reason, nodelist))
    return sorted(out, key=lambda c: c.offset)


def job_alive(job: str) -> bool:
    """True while any component of the job holds or waits for resources."""
    return any(c.state in LIVE_STATES for c in job_state(job))


def steps(job: str) -> list[tuple[str, str, str]]:
    """(step id, step name, nodelist) of the job's running steps, batch step excluded.

    A heterogeneous job lists each component's steps under the component's own job id.
    """
    ids = ",".join(c.job_id for c in job_state(job)) or job
    res = run(["squeue", "-h", "-s", "-j", ids, "-o", "%i|%j|%N"], check=False)
    out = []
    for line in res.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3 and not parts[0].endswith((".batch", ".extern")):
            out.append((parts[0], parts[1], parts[2]))
    return out


def cancel(job: str, signal: str | None = None, timeout: float = COMMAND_TIMEOUT) -> None:
    """``scancel JOB`` (the whole job), or with ``signal`` send it to the job's steps only."""
    argv = ["scancel", *(["--signal", signal] if signal else []), job]
    res = run(argv, timeout=timeout, check=False)
    if res.returncode != 0 and "Invalid job id" not in (res.stderr or "") \
            and "already completing or completed" not in (res.stderr or ""):
        raise SlurmError(f"`{shlex.join(argv)}` failed (exit {res.returncode}): {slurm_message(res)}")
