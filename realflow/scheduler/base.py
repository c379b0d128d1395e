"""What a launcher asks of a scheduler, whichever engine runs the processes.

The launcher describes every process of a run as a :class:`WorkerRequest` and hands the
whole list to a scheduler at once (``start``), so that a cluster scheduler can ask for all
resources in one job before anything runs (a Slurm heterogeneous job, Ray placement
groups). The local scheduler simply starts them. Afterwards every scheduler is watched the
same way: ``wait`` until the job is done (raising :class:`WorkerFailed` when a worker dies),
``stop_all`` to tear everything down.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: resource groups of a run: each becomes a component of a heterogeneous Slurm job
#: (or a placement-group bundle shape on Ray) when their resources differ
KINDS = ("master", "model_worker", "gen_server", "rollout")


class SchedulerError(RuntimeError):
    """A scheduler cannot start the job (the cluster refused it, or it cannot be placed);
    the message names the setting to change."""


@dataclass
class WorkerRequest:
    """One process of a run: its name (scheduler name, log file, RPC identity), command and needs."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    n_threads: int = 1
    kind: str = "model_worker"  # one of KINDS
    gpus: int = 0  # accelerators this process uses (model workers and gen servers on GPU clusters)
    service: bool = False  # serves the others: the job is done without it exiting
    expendable: bool = False  # its death is logged, not fatal (its users fail over)
    restarts: int = 0  # an expendable worker is started again up to this many times when it dies

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"worker '{self.name}': kind={self.kind!r} is not one of {', '.join(KINDS)}")


def make_scheduler(deploy: Any, log_dir: str, console: bool, job_name: str) -> Any:
    """The scheduler of ``deploy.launcher`` (local | slurm | ray), writing logs under ``log_dir``."""
    if deploy.launcher == "local":
        from realflow.scheduler.local import LocalScheduler

        return LocalScheduler(log_dir, console=console)
    if deploy.launcher == "slurm":
        from realflow.scheduler.slurm import SlurmScheduler

        return SlurmScheduler(log_dir, deploy.slurm, job_name=job_name, console=console)
    if deploy.launcher == "ray":
        from realflow.scheduler.ray import RayScheduler

        return RayScheduler(log_dir, deploy.ray, job_name=job_name, console=console)
    raise ValueError(f"launcher={deploy.launcher!r}: expected local, slurm or ray")
