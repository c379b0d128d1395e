"""``realflow plan``: the fastest allocations of an experiment on a (real or described) cluster.

    realflow plan model=qwen2.5-7b cluster=16xh100 experiment=grpo-math \\
        workload.gen_len_max=8192 batch_size=64 [--top 5] [--timeline plan.png] [--import MOD]

``model=``: a preset (:data:`MODEL_PRESETS`), a checkpoint directory or a config.json (every
role with a model gets it; ``models.<role>=`` gives one role another, e.g. ``models.critic=qwen2.5-1.5b``). ``cluster=``: ``<N>x<profile>``, a JSON file or ``local`` (this
machine's workers, with ``profile=`` from ``realflow calibrate``). ``workload.*``: sequence
lengths (:class:`Workload`). Every other ``key=value`` configures the experiment as on its own
command line. Prints the best plans (predicted step time, peak memory per device), the best
single global strategy beside them, and draws the best plan's timeline.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Optional

from realflow.api.experiment import experiment_registry
from realflow.config.cli import ConfigError, parse_overrides
from realflow.plugins import load_plugins

PLANNER_KEYS = ("model", "cluster", "profile", "sync_experiment")  # sync_experiment: --scaling's baseline
AREAL_FIGURE = ("AReaL (arXiv 2505.24298, abstract): up to 2.77x the training speed of synchronous systems with the "
                "same number of GPUs")


def _parse(argv: list[str]) -> tuple[argparse.Namespace, dict[str, str], dict[str, float], list[str]]:
    p = argparse.ArgumentParser(prog="realflow plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--top", type=int, default=5, help="how many plans to print")
    p.add_argument("--timeline", default="", help="PNG of the best plan's predicted timeline")
    p.add_argument("--import", dest="imports", action="append", default=[], help="plugin module")
    p.add_argument("--scaling", default="", help="device counts, e.g. 16,64,256,1024: predicted asynchronous and "
                   "synchronous throughput at each (the batch grows with the devices), beside AReaL's figure")
    args, rest = p.parse_known_args(argv)
    keys: dict[str, str] = {}
    workload: dict[str, float] = {}
    overrides: list[str] = []
    for a in rest:
        if a.startswith("-") or "=" not in a:
            raise ConfigError(f"realflow plan: unexpected argument {a!r} (key=value, --top, --timeline, --import)")
        k, v = a.split("=", 1)
        if k in PLANNER_KEYS or k == "experiment" or k.startswith("models."):
            keys[k] = v
        elif k.startswith("workload."):
            try:
                workload[k.split(".", 1)[1]] = float(v)
            except ValueError:
                raise ConfigError(f"{k}={v!r} is not a number") from None
        else:
            overrides.append(a)
    return args, keys, workload, overrides


def main(argv: Optional[list[str]] = None) -> int:
    from realflow.planner.cluster import parse_cluster
    from realflow.planner.models import load_model_config
    from realflow.planner.search import search
    from realflow.planner.simulate import Workload
    from realflow.planner.timeline import draw_timeline

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, keys, wl, overrides = _parse(argv)
        for k in ("model", "cluster", "experiment"):
            if k not in keys:
                raise ConfigError(f"realflow plan needs {k}=... (see `realflow plan --help`)")
        load_plugins(args.imports)  # the built-in experiments register the megatron backend too
        cls = experiment_registry.get(keys["experiment"])
        known = {f.name for f in dataclasses.fields(Workload)}
        bad = sorted(set(wl) - known)
        if bad:
            raise ConfigError(f"unknown workload key(s) {bad}; known: {sorted(known)}")
        workload = Workload(**wl)
        cfg = parse_overrides(cls, overrides)
        setup = cfg.setup()
        cluster = parse_cluster(keys["cluster"], local_devices=setup.n_workers,
                                local_profile=keys.get("profile", "cpu-example"))
        model = load_model_config(keys["model"])
        roles = _role_models(setup, keys, model)
        if args.scaling:
            return _scaling(cls, overrides, keys, cluster, model, workload, args.scaling)
        if setup.rollout is not None:
            from realflow.planner.async_plan import plan_async

            ap = plan_async(setup, cluster, roles, workload, seqs_per_step=_seqs(setup))
            print(cluster.describe())
            print(f"asynchronous: {ap.describe()}")
            print(ap.train.best.describe())
            return 0
        result = search(setup, cluster, roles, workload, top=args.top)
    except (ConfigError, KeyError, ValueError) as e:
        print(f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
        return 2
    gib = 2 ** 30
    print(cluster.describe())
    print(f"model {keys['model']}: {sum(1 for _ in roles)} role(s) {sorted(roles)}; experiment {keys['experiment']}; "
          f"{workload}")
    print(f"{result.evaluated} allocations evaluated, {len(result.rejected)} rejected")
    print(f"{'rank':<5}{'step s':>10}{'peak GiB':>10}{'vs global':>10}{'vs training':>12}  allocation")
    base = result.best_global.step_s if result.best_global else None
    train = result.best_training_strategy.step_s if result.best_training_strategy else None
    for i, p in enumerate(result.ranked, 1):
        ratio = f"{base / p.step_s:.2f}x" if base else "-"
        ratio_t = f"{train / p.step_s:.2f}x" if train else "-"
        print(f"{i:<5}{p.step_s:>10.4g}{p.max_peak_bytes / gib:>10.2f}{ratio:>10}{ratio_t:>12}  {p.allocation}")
    for label, g in (("best single global strategy", result.best_global),
                     ("best training strategy (generation's pp folded into dp)", result.best_training_strategy)):
        if g is not None:
            print(f"{label}: {g.allocation} ({g.step_s:.4g} s, {g.max_peak_bytes / gib:.2f} GiB)")
        else:
            print(f"{label}: none fits")
    print(result.best.describe())
    if args.timeline:
        png = draw_timeline(result.best, cluster.n_devices, args.timeline)
        print(f"timeline drawn to {png}")
    return 0


def _role_models(setup, keys: dict[str, str], model: dict) -> dict[str, dict]:
    """Every role with a model gets ``model=``, except those that ``models.<role>=`` names."""
    from realflow.planner.models import load_model_config

    roles = {r: model for r, spec in setup.models.items() if spec.backend != "none"}
    for k, v in keys.items():
        if k.startswith("models."):
            role = k.split(".", 1)[1]
            if role not in roles:
                raise ConfigError(f"{k}: the experiment has no role {role!r} with a model; its roles: {sorted(roles)}")
            roles[role] = load_model_config(v)
    return roles


def _seqs(setup) -> int:
    """Generated sequences per training step of an asynchronous setup."""
    n = int((setup.rollout.agent_args or {}).get("n_samples", 1))
    return max(m.n_seqs for m in setup.mfcs) * n


def _scaling(cls, overrides: list[str], keys: dict[str, str], cluster, model, workload, counts: str) -> int:
    """Weak scaling: the batch per device stays the experiment's; async vs sync at each count."""
    from realflow.planner.async_plan import plan_async
    from realflow.planner.cluster import parse_cluster
    from realflow.planner.search import search

    sync_cls = experiment_registry.get(keys.get("sync_experiment", "grpo-math"))
    base = parse_overrides(cls, overrides)
    per_device = base.batch_size / cluster.n_devices
    print(f"weak scaling on {cluster.device.name}: {per_device:g} prompts per device per step; {workload}")
    print(f"{'devices':>8}{'async samples/s':>17}{'sync samples/s':>16}{'async/sync':>11}{'async efficiency':>18}  plan")
    first = None
    for n in [int(x) for x in counts.split(",") if x.strip()]:
        bs = max(int(per_device * n), 1)
        over = [*overrides, f"batch_size={bs}"]
        cl = parse_cluster(f"{n}x{cluster.device.name}")
        a_setup = parse_overrides(cls, over).setup()
        s_setup = parse_overrides(sync_cls, [o for o in over if not o.startswith(("rollout.", "allocation="))]).setup()
        roles = {r: model for r, spec in s_setup.models.items() if spec.backend != "none"}
        seqs = _seqs(a_setup) if a_setup.rollout is not None else bs
        ap = plan_async(a_setup, cl, {r: model for r, spec in a_setup.models.items() if spec.backend != "none"},
                        workload, seqs_per_step=seqs)
        sp = search(s_setup, cl, roles, workload).best
        a_rate, s_rate = seqs / ap.step_s, seqs / sp.step_s
        first = first or (n, a_rate)
        eff = a_rate / (first[1] * n / first[0])
        print(f"{n:>8}{a_rate:>17.1f}{s_rate:>16.1f}{a_rate / s_rate:>10.2f}x{eff:>17.0%}  {ap.allocation}")
    print(f"published: {AREAL_FIGURE}")
    return 0

