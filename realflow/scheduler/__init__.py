"""Schedulers start, watch and stop a job's worker processes: local processes, Slurm, Ray."""
from realflow.scheduler.base import SchedulerError, WorkerRequest, make_scheduler
from realflow.scheduler.local import LocalScheduler, WorkerFailed

__all__ = ["LocalScheduler", "SchedulerError", "WorkerFailed", "WorkerRequest", "make_scheduler"]
