"""Schedulers start, watch and stop a job's worker processes: local processes, Slurm, Ray."""
from realflow.scheduler.base import SchedulerError, WorkerFailed, WorkerRequest, make_scheduler
from realflow.scheduler.local import LocalScheduler

__all__ = ["LocalScheduler", "SchedulerError", "WorkerFailed", "WorkerRequest", "make_scheduler"]
