"""The key layout of name resolution, in one place.

Every key lives under ``realflow/<experiment>/<trial>/`` so that several
experiments (and several trials of one experiment) can share one directory or one
etcd cluster, and ``clear_subtree(trial_root(...))`` cleans exactly one run.

What is published here: addresses (host:port or tcp://...), small status strings.
What is NOT: secrets. The MAC key of the control plane travels through a 0600
file or the environment, never through name resolution, which any process on the
cluster can read (``normalize_key`` refuses key names that look like secrets).
"""
from __future__ import annotations

from realflow.base.name_resolve import NameResolveError, normalize_key

ROOT = "realflow"


def _component(value: object, what: str) -> str:
    s = str(value)
    if "/" in s:
        raise NameResolveError(f"{what} {s!r} must not contain '/'")
    return normalize_key(s, what)


def trial_root(experiment: str, trial: str) -> str:
    """Root of everything one trial publishes."""
    return f"{ROOT}/{_component(experiment, 'experiment name')}/{_component(trial, 'trial name')}"


def master_address(experiment: str, trial: str) -> str:
    """Control-plane (ZMQ ROUTER) address of the master."""
    return f"{trial_root(experiment, trial)}/master/address"


def worker_root(experiment: str, trial: str, worker_type: str | None = None) -> str:
    """Subtree of all workers, or of one worker type (for ``wait_subtree``)."""
    root = f"{trial_root(experiment, trial)}/workers"
    return root if worker_type is None else f"{root}/{_component(worker_type, 'worker type')}"


def worker_address(experiment: str, trial: str, worker_type: str, index: int) -> str:
    """Address at which worker ``<worker_type>/<index>`` serves requests."""
    if not isinstance(index, int) or index < 0:
        raise NameResolveError(f"worker index must be an int >= 0, got {index!r}")
    return f"{worker_root(experiment, trial, worker_type)}/{index}"


def model_worker_name(index: int) -> str:
    """Name of model worker ``index``: its scheduler name, RPC identity and log role."""
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise NameResolveError(f"model worker index must be an int >= 0, got {index!r}")
    return f"model_worker/{index}"


def _worker_name(name: str) -> str:
    # Worker names may have several components ('model_worker/3').
    return normalize_key(str(name), "worker name")


def heartbeat_root(experiment: str, trial: str) -> str:
    return f"{trial_root(experiment, trial)}/heartbeat"


def heartbeat_address(experiment: str, trial: str, worker_name: str | None = None) -> str:
    """Heartbeat endpoint: the master's monitor (no ``worker_name``), or a worker's own
    socket (publish it with a TTL: the key then vanishes with the worker)."""
    root = heartbeat_root(experiment, trial)
    return f"{root}/monitor" if worker_name is None else f"{root}/workers/{_worker_name(worker_name)}"


def worker_status(experiment: str, trial: str, worker_name: str) -> str:
    """A worker's coarse status string ('ready', 'running', 'done', 'failed')."""
    return f"{trial_root(experiment, trial)}/status/{_worker_name(worker_name)}"


def distributed_address(experiment: str, trial: str, group: str = "world") -> str:
    """``host:port`` of the torch.distributed rendezvous (TCP store) of process group ``group``."""
    return f"{trial_root(experiment, trial)}/torch_distributed/{_component(group, 'group name')}"


def gen_server_root(experiment: str, trial: str) -> str:
    return f"{trial_root(experiment, trial)}/gen_servers"


def gen_server_address(experiment: str, trial: str, index: int) -> str:
    """HTTP base URL of generation server ``index`` (async PPO)."""
    if not isinstance(index, int) or index < 0:
        raise NameResolveError(f"gen server index must be an int >= 0, got {index!r}")
    return f"{gen_server_root(experiment, trial)}/{index}"


def rollout_controller_address(experiment: str, trial: str) -> str:
    """HTTP base URL of the rollout controller (async PPO)."""
    return f"{trial_root(experiment, trial)}/rollout_controller/address"


ROLLOUT_CONTROLLER = "rollout_controller"  # its scheduler name, RPC identity and log role


def rollout_worker_name(index: int) -> str:
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise NameResolveError(f"rollout worker index must be an int >= 0, got {index!r}")
    return f"rollout_worker/{index}"


def gen_server_name(index: int) -> str:
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise NameResolveError(f"gen server index must be an int >= 0, got {index!r}")
    return f"gen_server/{index}"


def trajectory_inbox_address(experiment: str, trial: str, index: int) -> str:
    """``tcp://host:port`` where model worker ``index`` receives finished trajectories (async PPO)."""
    if not isinstance(index, int) or index < 0:
        raise NameResolveError(f"model worker index must be an int >= 0, got {index!r}")
    return f"{trial_root(experiment, trial)}/trajectory_inbox/{index}"
