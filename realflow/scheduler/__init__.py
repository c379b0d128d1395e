"""Schedulers start, watch and stop a job's worker processes (local now; Slurm later)."""
from realflow.scheduler.local import LocalScheduler, WorkerFailed

__all__ = ["LocalScheduler", "WorkerFailed"]
