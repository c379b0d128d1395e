"""The planner's search on simulated clusters against the best single global strategy (issue 19).

    python -m benchmarks.bench_plan_search [--cases 7b,32b,70b]

For a 7B model on 16 H100s, 32B on 128 and 70B on 1024, three workloads each: GRPO (one model,
long reasoning generations), PPO in ReaLHF's shape (actor and reference of the model's size,
a smaller critic, KL in the reward) and PPO with an actor-sized critic. For each it prints the
best plan's predicted step time beside two baselines measured in the same run: the best single
global strategy (one dp/tp/pp for every MFC; generation cannot pipeline, so pp = 1) and the best
training strategy (the same, but generation folds pp into dp, as a Megatron user would write
it). Goal: the best plan at least 1.2x faster than the best single global strategy, never slower.
Where a global strategy does not fit at all, the speedup is unbounded ("none fits").
Beside each, a lower bound on any plan's step (realflow.planner.bound): where the global
strategy is within 1.2x of it, no plan can meet the goal there.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GOAL = 1.2


@dataclass(frozen=True)
class Case:
    name: str
    cluster: str
    experiment: str
    actor: str
    critic: str
    overrides: tuple[str, ...]
    workload: dict


def cases() -> list[Case]:
    out = []
    for tag, cluster, actor, small, prompts_grpo, prompts_ppo in (
            ("7b", "16xh100", "qwen2.5-7b", "qwen2.5-1.5b", 128, 512),
            ("32b", "128xh100", "qwen2.5-32b", "qwen2.5-7b", 1024, 1024),
            ("70b", "1024xh100", "llama3-70b", "qwen2.5-7b", 4096, 4096)):
        long_gen = {"prompt_len": 256.0, "gen_len_mean": 2048.0, "gen_len_max": 8192.0}
        short_gen = {"prompt_len": 256.0, "gen_len_mean": 512.0, "gen_len_max": 1024.0}
        out.append(Case(f"{tag} grpo", cluster, "grpo-math", actor, actor,
                        (f"batch_size={prompts_grpo}", "ppo.n_samples=8", "ppo.max_new_tokens=8192"), long_gen))
        ppo = (f"batch_size={prompts_ppo}", "ppo.kl_coef=0.05", "ppo.max_new_tokens=1024")
        out.append(Case(f"{tag} ppo small critic", cluster, "ppo-math", actor, small, ppo, short_gen))
        out.append(Case(f"{tag} ppo same critic", cluster, "ppo-math", actor, actor, ppo, short_gen))
    return out


def run_case(case: Case, root: str):
    from realflow.config.cli import parse_overrides
    from realflow.api.experiment import experiment_registry
    from realflow.planner.cluster import parse_cluster
    from realflow.planner.models import load_model_config
    from realflow.planner.search import search
    from realflow.planner.simulate import Workload

    setup = parse_overrides(experiment_registry.get(case.experiment), [f"fileroot={root}", *case.overrides]).setup()
    roles = {r: load_model_config(case.critic if r == "critic" else case.actor)
             for r, spec in setup.models.items() if spec.backend != "none"}
    from realflow.planner.bound import step_lower_bound

    cluster, workload = parse_cluster(case.cluster), Workload(**case.workload)
    t0 = time.perf_counter()
    result = search(setup, cluster, roles, workload)
    secs = time.perf_counter() - t0
    return result, secs, step_lower_bound(result.best, setup, cluster, roles, workload)


def _ratio(base, best) -> str:
    return f"{base.step_s / best.step_s:.2f}x" if base is not None else "none fits"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="7b,32b,70b", help="which clusters (7b, 32b, 70b)")
    args = ap.parse_args()
    from realflow.config.cli import import_modules

    import_modules(["experiments", "parallel.backend"])
    wanted = {c.strip() for c in args.cases.split(",")}
    root = tempfile.mkdtemp(prefix="bench_plan_search-")
    rows = []
    print(f"{'case':<22}{'cluster':<11}{'plans':>7}{'search s':>9}{'best s':>9}{'global s':>10}{'training s':>11}"
          f"{'vs global':>11}{'vs training':>12}{'bound s':>9}{'global/bound':>13}")
    for case in cases():
        if case.name.split()[0] not in wanted:
            continue
        res, secs, bound = run_case(case, root)
        g, t, b = res.best_global, res.best_training_strategy, res.best
        never_slower = all(x is None or b.step_s <= x.step_s * (1 + 1e-9) for x in (g, t))
        rows.append((case, res, never_slower, bound))
        attainable = f"{g.step_s / bound.seconds:.2f}x" if g else "-"
        print(f"{case.name:<22}{case.cluster:<11}{res.evaluated:>7}{secs:>9.1f}{b.step_s:>9.2f}"
              f"{(f'{g.step_s:.2f}' if g else '-'):>10}{(f'{t.step_s:.2f}' if t else '-'):>11}"
              f"{_ratio(g, b):>11}{_ratio(t, b):>12}{bound.seconds:>9.2f}{attainable:>13}", flush=True)
    print()
    for case, res, never_slower, bound in rows:
        gen = [m for m in res.best.mfcs if m.kind == "generate"]
        share = sum(m.end - m.start for m in gen) / res.best.step_s
        print(f"{case.name}: best {res.best.allocation}\n    generation {share:.0%} of the step; "
              f"never slower than a global plan: {never_slower}; no plan faster than {bound.seconds:.2f} s "
              f"(chain {bound.chain_s:.2f} s, work {bound.work_s:.2f} s; best found {res.best.step_s / bound.seconds:.2f}x "
              f"the bound)")
    met = [c.name for c, r, _, _ in rows if r.best_global is None or r.speedup_over_global >= GOAL]
    unattainable = [c.name for c, r, _, bd in rows
                    if r.best_global is not None and r.best_global.step_s / bd.seconds < GOAL]
    print(f"\ngoal ({GOAL}x over the best single global strategy): met in {len(met)}/{len(rows)} cases "
          f"({', '.join(met) or 'none'}); never slower in {sum(ns for *_, ns, _ in rows)}/{len(rows)}")
    print(f"unattainable by any plan (the global strategy within {GOAL}x of the lower bound): "
          f"{len(unattainable)}/{len(rows)} ({', '.join(unattainable) or 'none'})")
    return 0 if all(ns for *_, ns, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
