"""Where a run's processes go and how it survives faults: launcher and recovery settings.

Every experiment has these fields (through :class:`realflow.api.experiment.BaseExperimentConfig`),
so ``launcher=slurm slurm.partition=gpu recover_mode=auto recover_freq_steps=50`` works for SFT,
sync PPO and async PPO alike. They are checked here, where the user sets them, so a bad value
fails in one line before any process or job starts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

LAUNCHERS = ("local", "slurm", "ray")
RECOVER_MODES = ("auto", "resume", "off")
_TIME_RE = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")  # Slurm: minutes, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]


@dataclass
class SlurmConfig:
    """One Slurm job per experiment; every worker is an ``srun`` step of it."""

    partition: str = field(default="", metadata={"help": "partition ('' = the cluster's default)"})
    account: str = field(default="", metadata={"help": "account to charge ('' = the user's default)"})
    time_limit: str = field(default="", metadata={"help": "job time limit, Slurm syntax e.g. 04:00:00 ('' = partition default)"})
    nodelist: str = field(default="", metadata={"help": "run on these nodes only, Slurm syntax e.g. n[1-2] ('' = any)"})
    gpus_per_node: int = field(default=0, metadata={"help": "GPUs per node to request (0 = CPU job)"})
    cpus_per_worker: int = field(default=0, metadata={"help": "CPUs per worker process (0 = worker_threads)"})
    mem_per_worker_mb: int = field(default=0, metadata={"help": "memory per worker process in MB (0 = Slurm's default)"})
    submit_timeout_s: float = field(default=300.0, metadata={"help": "seconds to wait for the job's resources"})

    def __post_init__(self) -> None:
        if self.time_limit and not _TIME_RE.match(self.time_limit):
            raise ValueError(f"slurm.time_limit={self.time_limit!r}: expected Slurm time syntax, "
                             "e.g. 30, 04:00:00 or 1-12:00:00")
        for name in ("gpus_per_node", "cpus_per_worker", "mem_per_worker_mb"):
            if getattr(self, name) < 0:
                raise ValueError(f"slurm.{name}={getattr(self, name)} must be >= 0")
        if self.submit_timeout_s <= 0:
            raise ValueError(f"slurm.submit_timeout_s={self.submit_timeout_s} must be > 0")


@dataclass
class RayConfig:
    """Workers as Ray actors in placement groups (``pip install ray``)."""

    address: str = field(default="auto", metadata={"help": "Ray cluster address ('auto' = the running local head)"})
    cpus_per_worker: int = field(default=0, metadata={"help": "CPUs per worker (0 = worker_threads)"})
    gpus_per_worker: float = field(default=0.0, metadata={"help": "GPUs per model worker"})
    connect_timeout_s: float = field(default=60.0, metadata={"help": "seconds to reach the cluster and place workers"})


@dataclass
class RecoverSpec:
    """Recover points and automatic restarts (see realflow/system/recover.py)."""

    mode: str = "auto"  # auto: write points, resume, relaunch after a fault | resume: no relaunch | off
    freq_steps: int = 0  # a point every N steps (0 = by time only)
    freq_seconds: float = 600.0  # ... and/or when this many seconds passed since the last (0 = by steps only)
    retries: int = 3  # relaunches after faults (auto mode)
    keep: int = 2  # recover points kept (older ones are pruned)

    def __post_init__(self) -> None:
        if self.mode not in RECOVER_MODES:
            raise ValueError(f"recover_mode={self.mode!r}: expected one of {', '.join(RECOVER_MODES)}")
        if self.freq_steps < 0 or self.freq_seconds < 0:
            raise ValueError(f"recover_freq_steps={self.freq_steps}, recover_freq_seconds={self.freq_seconds}: "
                             "must be >= 0")
        if self.retries < 0:
            raise ValueError(f"recover_retries={self.retries} must be >= 0")
        if self.keep < 1:
            raise ValueError(f"recover_keep={self.keep} must be >= 1")

    @property
    def writes(self) -> bool:
        return self.mode != "off" and (self.freq_steps > 0 or self.freq_seconds > 0)


@dataclass
class DeploySpec:
    """The launcher part of an :class:`~realflow.api.experiment.ExperimentSetup`."""

    launcher: str = "local"
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            from realflow.api.registry import closest

            hint = closest(self.launcher, list(LAUNCHERS))
            raise ValueError(f"launcher={self.launcher!r} is not a launcher; choose one of {', '.join(LAUNCHERS)}"
                             + (f" (did you mean {hint[0]}?)" if hint else ""))

    @property
    def cluster(self) -> bool:
        """Processes may be on other hosts: bind to the node's address, not loopback."""
        return self.launcher != "local"
