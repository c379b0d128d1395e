"""``allocation=auto``: search the allocation for this experiment on this machine.

The cluster is this machine: one node, one device per worker, the device profile from
``REALFLOW_DEVICE_PROFILE`` (a file written by ``realflow calibrate``), else the shipped
profile of the local GPU model, else the shipped ``cpu-example`` (measured on the
development machine: a rough guide only -- calibrate for real choices). Sequence lengths
are not known before a run, so the workload assumes half of each configured limit; the
explanation printed with the choice says so, with the predicted times it compared.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from realflow.api.experiment import ExperimentSetup
from realflow.api.mfc import ModelInterfaceType
from realflow.system.plan import PlanError
from realflow.planner.cluster import ClusterSpec, cluster_from_dict
from realflow.planner.profile import shipped_profiles
from realflow.planner.search import NoPlanFits, search
from realflow.planner.simulate import Workload

PROFILE_ENV = "REALFLOW_DEVICE_PROFILE"


def local_profile_name() -> str:
    """Which profile describes this machine's devices (see module docstring)."""
    if os.environ.get(PROFILE_ENV):
        return os.environ[PROFILE_ENV]
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name().lower()
            for name in shipped_profiles():
                if name in gpu:
                    return name
    except ImportError:
        pass
    return "cpu-example"


def local_cluster(n_workers: int) -> ClusterSpec:
    d: dict[str, Any] = {"nodes": 1, "devices_per_node": n_workers, "device": local_profile_name(), "name": "local"}
    mem = _host_memory_per_worker(n_workers)
    if mem is not None:
        d["memory_bytes"] = mem
    return cluster_from_dict(d, where="allocation=auto (this machine)")


def _host_memory_per_worker(n_workers: int) -> Optional[int]:
    try:
        import torch

        if torch.cuda.is_available():
            return None  # the GPU profile's memory
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
        return kib * 1024 // max(n_workers, 1)
    except (OSError, StopIteration, ImportError):
        return None


def assumed_workload(setup: ExperimentSetup) -> Workload:
    """Half of each configured length limit (the run's real lengths are unknown before it); a
    batch's longest sequence at the limit."""
    args = setup.dataset.args
    limits = [float(m.interface_args.get("max_new_tokens", 0)) for m in setup.mfcs
              if m.interface_type == ModelInterfaceType.GENERATE]
    if setup.rollout is not None:  # asynchronous: the rollout agent generates
        limits.append(float((setup.rollout.agent_args or {}).get("max_new_tokens", 0)))
    gen_max = max(limits, default=0.0) or 512.0
    prompt = float(args.get("max_prompt_len") or 256) / 2
    seq_limit = float(args.get("max_seq_len") or 1024)
    return Workload(prompt_len=max(prompt, 1.0), gen_len_mean=max(gen_max / 2, 1.0), gen_len_max=gen_max,
                    seq_len=max(seq_limit / 2, 1.0), seq_len_max=max(seq_limit, 1.0))


def model_configs(setup: ExperimentSetup) -> dict[str, dict[str, Any]]:
    """Role -> HF config of every role with a model (its checkpoint's, or the planned one)."""
    import json

    out = {}
    for role, spec in setup.models.items():
        if spec.backend == "none":
            continue
        path = os.path.join(spec.path, "config.json")
        if os.path.isfile(path):
            with open(path) as f:
                out[role] = json.load(f)
        elif spec.expected_config is not None:
            out[role] = dict(spec.expected_config)
        else:
            raise PlanError(f"allocation=auto: model {role!r} has no config.json at {spec.path!r} and no planned "
                            f"config; give an allocation instead")
    return out


def choose_allocation(setup: ExperimentSetup) -> tuple[str, str]:
    """(the best allocation found, a few lines saying what was compared and assumed)."""
    if setup.rollout is not None:
        return _choose_async(setup)
    cluster = local_cluster(setup.n_workers)
    workload = assumed_workload(setup)
    base = dataclasses.replace(setup, allocation=f"d{setup.n_workers}")
    try:
        result = search(base, cluster, model_configs(setup), workload, top=3)
    except NoPlanFits as e:
        raise PlanError(f"allocation=auto: {e}") from None
    lines = [f"allocation=auto chose {result.best.allocation!r} (predicted step {result.best.step_s:.3g} s) "
             f"on {cluster.describe()}",
             f"  workload assumed: {workload}",
             f"  {result.evaluated} allocations evaluated, {len(result.rejected)} could not run"]
    if result.best_global is not None:
        lines.append(f"  best single global strategy: {result.best_global.allocation!r} "
                     f"({result.best_global.step_s:.3g} s)")
    lines += [f"  runner-up: {p.allocation!r} ({p.step_s:.3g} s)" for p in result.ranked[1:]]
    return result.best.allocation, "\n".join(lines)


def _choose_async(setup: ExperimentSetup) -> tuple[str, str]:
    """An asynchronous run: ``n_workers`` devices split between generation servers and the
    trainer (:func:`.async_plan.plan_async`); servers of the builtin backend are one process each."""
    from realflow.api.allocation import ParallelStrategy
    from realflow.planner.async_plan import plan_async
    from realflow.planner.search import short

    cluster = local_cluster(setup.n_workers)
    if cluster.n_devices < 2:
        raise PlanError(f"allocation=auto: an asynchronous run needs at least 2 workers (one generation server, "
                        f"one trainer); n_workers={setup.n_workers}")
    workload = assumed_workload(setup)
    trainer = dataclasses.replace(setup, allocation=f"d{setup.n_workers}")
    n_samples = int((setup.rollout.agent_args or {}).get("n_samples", 1))
    max_tp = 1 if setup.rollout.backend == "builtin" else cluster.devices_per_node
    try:
        ap = plan_async(trainer, cluster, model_configs(setup), workload, max_running=setup.rollout.max_running_requests,
                        seqs_per_step=max(m.n_seqs for m in setup.mfcs) * n_samples, max_gen_tp=max_tp)
    except NoPlanFits as e:
        raise PlanError(f"allocation=auto: {e}") from None
    train = ap.train.best.allocation
    gen = short(ParallelStrategy(dp=ap.gen_devices // ap.gen_tp, tp=ap.gen_tp))
    chosen = f"gen:{gen}+" + (f"train:{train}" if "," not in train else train)
    lines = [f"allocation=auto chose {chosen!r} on {cluster.describe()}",
             f"  predicted: {ap.describe()}",
             f"  workload assumed: {workload}",
             f"  {ap.considered} generation/training splits compared"
             + ("; builtin servers are one process each (tp=1)" if max_tp == 1 else "")]
    return chosen, "\n".join(lines)
