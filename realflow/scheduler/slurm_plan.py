"""Where each process of a run goes in its Slurm job: nodes, components and step options.

Pure planning (no Slurm calls), so it can be checked on its own and its errors come
before anything is submitted.

Why components are node groups, not roles: Slurm gives every component of a
heterogeneous job its own nodes (slurmctld adds the nodes of the other components to a
component's excluded list). One component per role would give the master, a one-CPU
process, a node of its own, and an asynchronous run (master, model workers, generation
servers, rollout) would need four nodes at least. So the plan places processes on
*node slots* first, then asks for one component per distinct per-node shape (CPUs,
memory, GPUs): a plain job when every node needs the same, a heterogeneous job when they
differ (e.g. the first node also runs the master). Nothing is over-allocated.

Placement: model workers and generation servers are spread evenly over the nodes in
blocks (consecutive ranks share a node, so tensor-parallel groups stay together); the
master, the rollout controller and rollout workers go to the first node. With
``slurm.nodelist`` the job uses exactly those nodes; otherwise as few nodes as fit the
partition's smallest node (CPUs, memory) and ``slurm.gpus_per_node``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from realflow.scheduler.base import WorkerRequest
from realflow.scheduler.slurm_cli import NodeInfo

SPREAD_KINDS = ("model_worker", "gen_server")  # spread over nodes; slurm.cpus_per_worker applies


class PlanError(ValueError):
    """The run cannot be placed with this Slurm config; the message names the config field."""


@dataclass(frozen=True)
class Need:
    """Resources of one process, or of all processes on one node."""

    cpus: int
    mem_mb: int = 0  # 0: Slurm's default
    gpus: int = 0

    def __add__(self, other: "Need") -> "Need":
        return Need(self.cpus + other.cpus, self.mem_mb + other.mem_mb, self.gpus + other.gpus)


@dataclass
class Component:
    """One component of the job: ``len(slots)`` nodes, each with ``shape`` resources."""

    shape: Need
    slots: list[int]  # node slots of the plan in this component
    nodelist: list[str] = field(default_factory=list)  # the nodes asked for by name ([] = Slurm picks)


@dataclass
class JobPlan:
    """Node slots, the component of each slot and each process's slot and needs."""

    components: list[Component]
    slot_of: dict[str, int]  # process name -> node slot
    need_of: dict[str, Need]  # process name -> its resources

    @property
    def het(self) -> bool:
        return len(self.components) > 1

    def component_of(self, slot: int) -> int:
        return next(i for i, c in enumerate(self.components) if slot in c.slots)

    def slot_members(self, slot: int) -> list[str]:
        return [n for n, s in self.slot_of.items() if s == slot]

    def sbatch_args(self, cfg: Any, job_name: str) -> list[str]:
        """sbatch options: the job-wide ones, then each component's, ':'-separated."""
        args: list[str] = []
        for i, c in enumerate(self.components):
            if i:
                args.append(":")
            args += [f"--job-name={job_name}", "--output=/dev/null", "--no-requeue"]
            args += [f"--partition={cfg.partition}"] if cfg.partition else []
            args += [f"--account={cfg.account}"] if cfg.account else []
            args += [f"--time={cfg.time_limit}"] if cfg.time_limit else []
            args += [f"--nodes={len(c.slots)}", "--ntasks-per-node=1", f"--cpus-per-task={c.shape.cpus}"]
            args += [f"--mem={c.shape.mem_mb}M"] if c.shape.mem_mb else []
            args += [f"--gpus-per-node={c.shape.gpus}"] if c.shape.gpus else []
            args += [f"--nodelist={','.join(c.nodelist)}"] if c.nodelist else []
        return args

    def srun_args(self, name: str, job_id: str, node: str) -> list[str]:
        """srun options that run process ``name`` as a one-task step on ``node``."""
        need, slot = self.need_of[name], self.slot_of[name]
        args = ["srun", f"--jobid={job_id}"]
        args += [f"--het-group={self.component_of(slot)}"] if self.het else []
        args += ["--nodes=1", "--ntasks=1", f"--cpus-per-task={need.cpus}", "--exact", f"--nodelist={node}",
                 f"--job-name={name}", "--kill-on-bad-exit=1", "--quiet"]
        args += [f"--mem={need.mem_mb}M"] if need.mem_mb else []
        args += [f"--gpus={need.gpus}"] if need.gpus else []
        return args

    def describe(self) -> str:
        lines = []
        for slot in range(sum(len(c.slots) for c in self.components)):
            comp = self.components[self.component_of(slot)]
            lines.append(f"node slot {slot} (component {self.component_of(slot)}, {comp.shape.cpus} CPUs"
                         + (f", {comp.shape.gpus} GPUs" if comp.shape.gpus else "") + "): "
                         + ", ".join(self.slot_members(slot)))
        return "\n".join(lines)


def process_need(r: WorkerRequest, cfg: Any) -> Need:
    """CPUs (slurm.cpus_per_worker for model workers and gen servers, else the process's threads),
    memory (slurm.mem_per_worker_mb, for every process, so each step states its share) and GPUs."""
    cpus = cfg.cpus_per_worker if cfg.cpus_per_worker and r.kind in SPREAD_KINDS else r.n_threads
    return Need(cpus, cfg.mem_per_worker_mb, r.gpus)


def _candidates(cfg: Any, nodes: Sequence[NodeInfo], nodelist: Sequence[str]) -> list[NodeInfo]:
    """The nodes the job may use: the named ones, else those of the (default) partition."""
    parts = sorted({p for n in nodes for p in n.partitions})
    if cfg.partition:
        pool = [n for n in nodes if cfg.partition in n.partitions]
        if not pool:
            raise PlanError(f"slurm.partition={cfg.partition}: no such partition (partitions: "
                            f"{', '.join(parts) or 'none'})")
        where = f"partition {cfg.partition}"
    else:
        pool = [n for n in nodes if n.default_partition]
        if not pool:
            raise PlanError(f"the cluster has no default partition: set slurm.partition (partitions: "
                            f"{', '.join(parts) or 'none'})")
        where = "the default partition"
    if not nodelist:
        return pool
    twice = sorted({n for n in nodelist if list(nodelist).count(n) > 1})
    if twice:
        raise PlanError(f"slurm.nodelist={cfg.nodelist}: names {', '.join(twice)} more than once")
    by_name = {n.name: n for n in pool}
    unknown = [n for n in nodelist if n not in by_name]
    if unknown:
        known = ", ".join(sorted(by_name)) or "none"
        raise PlanError(f"slurm.nodelist={cfg.nodelist}: no node named {', '.join(unknown)} in {where} "
                        f"(its nodes: {known})")
    return [by_name[n] for n in nodelist]


def _distribute(requests: Sequence[WorkerRequest], k: int) -> list[list[WorkerRequest]]:
    slots: list[list[WorkerRequest]] = [[] for _ in range(k)]
    for kind in SPREAD_KINDS:
        rs = [r for r in requests if r.kind == kind]
        for i, r in enumerate(rs):
            slots[i * k // len(rs)].append(r)
    slots[0][:0] = [r for r in requests if r.kind not in SPREAD_KINDS]
    return slots


def _misfit(members: list[WorkerRequest], need: Need, cap: NodeInfo | None, cfg: Any) -> str:
    """Why ``members`` do not fit on ``cap`` ('' if they do)."""
    if not members:
        return "no process to run there"
    if cap is not None and need.cpus > cap.cpus:
        return f"needs {need.cpus} CPUs but has {cap.cpus}"
    if cap is not None and need.mem_mb and cap.mem_mb and need.mem_mb > cap.mem_mb:
        return f"needs {need.mem_mb} MB but has {cap.mem_mb} MB"
    if cfg.gpus_per_node and need.gpus > cfg.gpus_per_node:
        return f"needs {need.gpus} GPUs but slurm.gpus_per_node={cfg.gpus_per_node}"
    return ""


def _check_each_fits(requests: Sequence[WorkerRequest], need: dict[str, Need], pool: list[NodeInfo],
                     cfg: Any) -> None:
    """A process larger than every node: name the config field that asks too much."""
    cpus = max(pool, key=lambda n: n.cpus)
    mem = max(pool, key=lambda n: n.mem_mb)
    for r in requests:
        n = need[r.name]
        if n.cpus > cpus.cpus:
            asked = (f"slurm.cpus_per_worker={cfg.cpus_per_worker}" if cfg.cpus_per_worker and r.kind in SPREAD_KINDS
                     else f"{r.n_threads} threads, from worker_threads")
            raise PlanError(f"{r.name} needs {n.cpus} CPUs ({asked}) but the largest node the job may use "
                            f"({cpus.name}) has {cpus.cpus}")
        if n.mem_mb and mem.mem_mb and n.mem_mb > mem.mem_mb:
            raise PlanError(f"slurm.mem_per_worker_mb={cfg.mem_per_worker_mb}: more than the largest node the job "
                            f"may use ({mem.name}: {mem.mem_mb} MB)")
        if cfg.gpus_per_node and n.gpus > cfg.gpus_per_node:
            raise PlanError(f"{r.name} uses {n.gpus} GPUs, more than slurm.gpus_per_node={cfg.gpus_per_node}")


def plan_job(requests: Sequence[WorkerRequest], cfg: Any, nodes: Sequence[NodeInfo],
             nodelist: Sequence[str] = ()) -> JobPlan:
    """Place every process on a node slot and group the slots into job components.

    ``nodes`` is the cluster as sinfo lists it; ``nodelist`` the expansion of
    ``cfg.nodelist``. Raises PlanError naming the config field that makes the run not fit.
    """
    if not requests:
        raise PlanError("no processes to run")
    need = {r.name: process_need(r, cfg) for r in requests}
    for r in requests:
        if r.gpus and not cfg.gpus_per_node:
            raise PlanError(f"{r.name} uses {r.gpus} GPUs but slurm.gpus_per_node=0 (a CPU job)")
    pool = _candidates(cfg, nodes, nodelist)
    smallest = min(pool, key=lambda n: (n.cpus, n.mem_mb)) if pool else None
    if pool:
        _check_each_fits(requests, need, pool, cfg)
    sizes = [len(nodelist)] if nodelist else range(1, max(1, len(pool)) + 1)
    last = ""
    for k in sizes:
        slots = _distribute(requests, k)
        caps = list(pool) if nodelist else [smallest] * k
        sums = [sum((need[r.name] for r in s), Need(0)) for s in slots]
        misfits = [(i, _misfit(s, sums[i], caps[i], cfg)) for i, s in enumerate(slots)]
        bad = [(i, why) for i, why in misfits if why]
        if not bad:
            return _group(slots, sums, list(nodelist), need)
        i, why = bad[0]
        node = nodelist[i] if nodelist else f"node slot {i}"
        last = f"{node} would run {', '.join(r.name for r in slots[i]) or 'nothing'}: {why}"
    if nodelist:
        raise PlanError(f"slurm.nodelist={cfg.nodelist}: {last}; name other nodes or ask for less "
                        "(slurm.cpus_per_worker, worker_threads, slurm.mem_per_worker_mb, n_workers)")
    raise PlanError(f"the run does not fit on the {len(pool)} nodes the job may use ({last}); lower "
                    "slurm.cpus_per_worker, worker_threads, slurm.mem_per_worker_mb or n_workers, or choose "
                    "another slurm.partition")


def _group(slots: list[list[WorkerRequest]], sums: list[Need], nodelist: list[str],
           need: dict[str, Need]) -> JobPlan:
    components: list[Component] = []
    for i, shape in enumerate(sums):
        comp = next((c for c in components if c.shape == shape), None)
        if comp is None:
            comp = Component(shape, [])
            components.append(comp)
        comp.slots.append(i)
        if nodelist:
            comp.nodelist.append(nodelist[i])
    slot_of = {r.name: i for i, s in enumerate(slots) for r in s}
    return JobPlan(components, slot_of, need)
