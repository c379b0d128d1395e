"""Predict one step of an experiment under an allocation, through the runtime's own plan compiler.

:func:`simulate` compiles the plan exactly as a run would (:func:`compile_plan`: placements,
homes, reallocation / offload hooks, transfers, layout checks against the cluster's memory),
then prices each piece with :mod:`.cost` and replays the step on a per-device clock: an MFC
starts when its producers have finished and all its devices are free; its hooks run on its
devices before and after it. Peak memory per device is the resident state of the roles homed
there (weights, and for trained roles fp32 grads and Adam states, from the backend's own
estimate) plus the largest transient of the MFCs it runs (a reallocated copy of the weights,
activations, logits, KV cache). Offloaded roles are counted as resident: an upper bound.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from realflow.api.allocation import ParallelStrategy
from realflow.api.backend import model_backends
from realflow.api.experiment import ExperimentSetup
from realflow.api.mfc import ModelInterfaceType
from realflow.system.plan import ExecutionPlan, compile_plan
from realflow.system.plan_types import Offload, ParamRealloc, PlanError, Reload
from realflow.planner.cluster import ClusterSpec
from realflow.planner.cost import Cost, ModelFacts, Work, activation_bytes, mfc_cost, p2p_s

_KIND = {ModelInterfaceType.GENERATE: "generate", ModelInterfaceType.INFERENCE: "inference",
         ModelInterfaceType.TRAIN_STEP: "train"}


@dataclass(frozen=True)
class Workload:
    """Sequence lengths of a step (tokens): the planner's view of the data."""

    prompt_len: float = 256.0
    gen_len_mean: float = 512.0
    gen_len_max: float = 1024.0
    seq_len: float = 1024.0  # sequences without generation (SFT): their mean length
    seq_len_max: float = 0.0  # ... and a batch's longest (0: all seq_len long); a padded engine pays it
    max_tokens_per_mb: float = 16384.0  # micro-batch budget assumed for MFCs that set none

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name == "seq_len_max" and self.seq_len_max == 0:
                continue
            if not getattr(self, f.name) > 0:
                raise ValueError(f"workload {f.name}={getattr(self, f.name)!r} must be > 0")
        if self.seq_len_max and self.seq_len_max < self.seq_len:
            raise ValueError(f"workload seq_len_max={self.seq_len_max} < seq_len={self.seq_len}")
        if self.gen_len_max < self.gen_len_mean:
            raise ValueError(f"workload gen_len_max={self.gen_len_max} < gen_len_mean={self.gen_len_mean}")


@dataclass
class MFCTiming:
    name: str
    role: str
    kind: str
    layout: str
    workers: tuple[int, ...]
    start: float
    end: float
    cost: Cost
    hooks_s: float


@dataclass
class Prediction:
    allocation: str
    step_s: float
    mfcs: list[MFCTiming]
    peak_bytes: dict[int, float]
    capacity_bytes: int
    plan: ExecutionPlan
    notes: list[str] = field(default_factory=list)

    @property
    def max_peak_bytes(self) -> float:
        return max(self.peak_bytes.values(), default=0.0)

    @property
    def fits(self) -> bool:
        return self.max_peak_bytes <= self.capacity_bytes

    def describe(self) -> str:
        gib = 2 ** 30
        lines = [f"allocation {self.allocation!r}: step {self.step_s:.4g} s, peak memory "
                 f"{self.max_peak_bytes / gib:.2f} / {self.capacity_bytes / gib:.2f} GiB per device"]
        for m in self.mfcs:
            c = m.cost
            lines.append(f"  {m.name:<14} {m.layout:<10} {m.start:9.4g} -> {m.end:9.4g} s  compute {c.compute:.3g}"
                         f" overhead {c.overhead:.3g} tp {c.tp_comm:.3g} pp {c.pp_comm + c.bubble:.3g}"
                         f" dp {c.dp_sync:.3g} opt {c.optimizer:.3g} hooks {m.hooks_s:.3g}")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def planned_setup(setup: ExperimentSetup, model_cfgs: dict[str, dict[str, Any]], cluster: ClusterSpec,
                  allocation: str) -> ExperimentSetup:
    """``setup`` on ``cluster``'s devices with ``allocation``, its models described by ``model_cfgs``
    (role -> HF config; roles not named keep their own) and in the cluster's training dtype (the
    profile's: bf16 on GPUs, fp32 on CPUs); a model asked to train in another one is refused, as
    the profile's rates would not be its rates."""
    dtype = "bf16" if cluster.device.params_bytes == 2 else "fp32"
    models = {}
    for role, spec in setup.models.items():
        if role in model_cfgs and spec.backend != "none":
            wanted = setup.model_precision(spec)
            if wanted not in ("auto", dtype):
                raise PlanError(f"model {role!r}: precision={wanted}, but device profile {cluster.device.name!r} "
                                f"prices {dtype} parameters; plan with precision=auto or {dtype}, or with a "
                                f"profile measured for {wanted}")
            spec = dataclasses.replace(spec, path=f"<planned:{role}>", expected_config=dict(model_cfgs[role]),
                                       precision=dtype)
        models[role] = spec
    return dataclasses.replace(setup, models=models, n_workers=cluster.n_devices, allocation=allocation)


def _row_savings(spec: Any, cfg: Optional[dict[str, Any]]) -> tuple[bool, bool]:
    """(pad-free, shared prompts) as the engine resolves ``training.*`` for this model: pad-free
    unless ``off``; a shared prompt needs pad-free rows and a dense text model (see
    parallel/shared_prefix.py)."""
    opts = getattr(spec, "training", None)
    if opts is None:
        return False, False
    pad_free = opts.pad_free != "off"
    cfg = cfg or {}
    dense_text = not (cfg.get("num_experts") or "vision_config" in cfg or "text_config" in cfg)
    return pad_free, pad_free and opts.shared_prefix != "off" and dense_text


def works_of(plan: ExecutionPlan, workload: Workload, rollout: Any = None,
             models: Optional[dict[str, Any]] = None,
             model_cfgs: Optional[dict[str, dict[str, Any]]] = None) -> dict[str, Work]:
    """What each MFC processes. An asynchronous trainer's graph has no generate MFC: its MFCs
    take ``n_seqs`` rollouts of the rollout agent's ``n_samples`` generated sequences each.
    ``models`` (role -> ModelSpec) and ``model_cfgs`` (role -> HF config): ``training.pad_free`` /
    ``shared_prefix`` and whether the model can take them, which set the rows a train or
    inference MFC computes."""
    gens = [m for m in plan.graph.mfcs if m.interface_type == ModelInterfaceType.GENERATE]
    generated = max((m.n_seqs * int(m.interface_args.get("n_samples", 1)) for m in gens), default=0)
    per_rollout = int((getattr(rollout, "agent_args", None) or {}).get("n_samples", 1)) if rollout is not None else 0
    gen_group = max((int(m.interface_args.get("n_samples", 1)) for m in gens), default=1)  # answers per prompt
    out = {}
    for m in plan.graph.mfcs:
        kind = _KIND[m.interface_type]
        mb = int(m.mb_spec.max_tokens_per_mb or 0)
        ups = int(m.interface_args.get("ppo_epochs", 1)) * int(m.interface_args.get("n_minibatches", 1))
        if kind == "generate":
            max_new = float(m.interface_args.get("max_new_tokens", workload.gen_len_max))
            gmax = min(workload.gen_len_max, max_new)
            out[m.name] = Work("generate", m.n_seqs * int(m.interface_args.get("n_samples", 1)),
                               workload.prompt_len + min(workload.gen_len_mean, gmax), workload.prompt_len,
                               gmax, min(workload.gen_len_mean, gmax), mb)
            continue
        role = plan.placements[m.name].role
        spec = (models or {}).get(role)
        pad_free, shared = _row_savings(spec, (model_cfgs or {}).get(role) or getattr(spec, "expected_config", None))
        if gens or per_rollout:
            group = max(gen_group, per_rollout, 1)
            out[m.name] = Work(kind, generated or m.n_seqs * per_rollout, workload.prompt_len + workload.gen_len_mean,
                               max_tokens_per_mb=mb or int(workload.max_tokens_per_mb),
                               updates=ups if kind == "train" else 1,
                               seq_len_max=workload.prompt_len + workload.gen_len_max,
                               seq_len_min=workload.prompt_len + 1, group=group, pad_free=pad_free,
                               shared_prompt=workload.prompt_len if shared and group > 1 else 0.0)
        else:
            out[m.name] = Work(kind, m.n_seqs, workload.seq_len, max_tokens_per_mb=mb or int(workload.max_tokens_per_mb),
                               updates=ups if kind == "train" else 1, seq_len_max=workload.seq_len_max,
                               pad_free=pad_free)
    return out


def _state_bytes(backend: Any, cfg: dict[str, Any], s: ParallelStrategy, trained: bool, low: bool) -> float:
    fn = getattr(backend, "rank_state_bytes", None)
    return float(fn(cfg, s, trained, low)[1]) if fn is not None else 0.0


def simulate(setup: ExperimentSetup, cluster: ClusterSpec, model_cfgs: dict[str, dict[str, Any]],
             workload: Workload, allocation: Optional[str] = None) -> Prediction:
    """Predict one step of ``setup`` on ``cluster`` (see module docstring). Raises PlanError /
    AllocationError when the allocation cannot run (structure, or state that does not fit)."""
    alloc = setup.allocation if allocation is None else allocation
    ps = planned_setup(setup, model_cfgs, cluster, alloc)
    plan = compile_plan(ps, capacity_bytes=cluster.device.memory_bytes)
    works = works_of(plan, workload, setup.rollout, ps.models, model_cfgs)
    facts = {r: ModelFacts.from_hf(c) for r, c in model_cfgs.items()}
    backends = {r: model_backends.get(ps.models[r].backend)() for r in facts}
    low = cluster.device.params_bytes == 2
    free = {w: 0.0 for w in range(cluster.n_devices)}
    resident = {w: 0.0 for w in free}
    for role, home in plan.role_home.items():
        if role in facts:
            b = _state_bytes(backends[role], model_cfgs[role], home.strategy, role in plan.trained_roles, low)
            for w in home.workers:
                resident[w] += b
    end: dict[str, float] = {}
    timings = []
    transient = {w: 0.0 for w in free}
    for name in plan.graph.topological_order():
        p = plan.placements[name]
        role = p.role
        if role not in facts:
            continue  # a role without a model (rule reward): no device time worth counting
        s, workers = p.layout.strategy, p.layout.workers
        copy = 0.0 if p.layout == plan.role_home[role] else _state_bytes(backends[role], model_cfgs[role], s, False, low)
        work = works[name]
        if work.kind == "generate":  # the KV cache gets what the resident state and weights leave (90%)
            left = 0.9 * cluster.device.memory_bytes - max(resident[w] for w in workers) - copy
            work = dataclasses.replace(work, kv_budget_bytes=max(left, 1.0))
        hooks = sum(_hook_s(h, facts, cluster) for h in (*plan.pre_hooks.get(name, ()), *plan.post_hooks.get(name, ())))
        cost = mfc_cost(facts[role], s, workers, work, cluster)
        start = max([free[w] for w in workers] + [end.get(u, 0.0) for u in plan.graph.predecessors(name)])
        stop = start + hooks + cost.total
        for w in workers:
            free[w] = stop
        end[name] = stop
        timings.append(MFCTiming(name, role, work.kind, _layout_text(p.layout, cluster.n_devices), tuple(workers), start, stop, cost,
                                 hooks))
        extra = activation_bytes(facts[role], s, work, cluster.device.params_bytes,
                                 cluster.device.packed_attention) + copy
        for w in workers:
            transient[w] = max(transient[w], extra)
    peak = {w: resident[w] + transient[w] for w in free}
    # plan.transfers (token ids, rewards, log-probs between MFCs) are not priced: kilobytes to a
    # few megabytes per step, microseconds to milliseconds against MFCs of seconds
    return Prediction(alloc, max(end.values(), default=0.0), timings, peak, cluster.device.memory_bytes, plan,
                      list(plan.notes))


def _layout_text(layout: Any, n_devices: int) -> str:
    """``d2t4p2`` on every device, else with its devices (``d1t1p1@[0-3]``)."""
    text = layout.short()
    return text.split("@")[0] if len(layout.workers) == n_devices else text


def _hook_s(h: Any, facts: dict[str, ModelFacts], cluster: ClusterSpec) -> float:
    dev = cluster.device
    if isinstance(h, ParamRealloc):
        f = facts.get(h.dst_role)
        if f is None:
            return 0.0
        per_dst = f.params * dev.params_bytes / (h.dst.strategy.tp * h.dst.strategy.pp)
        return p2p_s(cluster.link(sorted(set(h.src.workers) | set(h.dst.workers))), per_dst)
    if isinstance(h, (Offload, Reload)):
        f = facts.get(h.role)
        if f is None:
            return 0.0
        s = h.layout.strategy
        return f.params * dev.params_bytes / (s.tp * s.pp) / dev.host_bandwidth
    return 0.0
