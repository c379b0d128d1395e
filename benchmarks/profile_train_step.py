"""Where the actor's GRPO train step spends its time: the default grpo-math step on one dp rank.

    python benchmarks/profile_train_step.py [--fileroot /tmp/bench_root] [--steps 5] [--threads 1]
                                            [--groups 32] [--dp 1] [--cprofile] [--torch-profile]

``--fileroot``: a file root where the default run (or ``benchmarks/bench_e2e_rl.py``) left its SFT
start and RL data. Builds the actor engine the way the default ``grpo-math`` run does (that
checkpoint, its optimizer, the ``training.*`` defaults) in one process (gloo, world size 1;
``--dp 2``: two processes, as the default run's actor layout d2 on two workers, each with its own
prompts) and runs ``PPOActorInterface.train_step`` on a batch shaped like one dp rank's share of
the default step: ``--groups`` prompts of the RL data x ``n_samples`` responses (the default run's
actor is d2, so 32 of the 64 prompts), the responses the SFT start's own samples (its generator,
as the generate MFC draws them), rewards random. Prints the mean step time (with ``--dp`` > 1 each
rank's wall and CPU time: the difference is waiting in collectives or for a core);
``--cprofile`` the top functions by cumulative and own time, ``--torch-profile`` the top torch
ops by CPU time (rank 0).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build(fileroot: str, groups: int, store: str, seed: int = 0, rank: int = 0, dp: int = 1):
    """``(interface, model, micro-batch spec, batch maker)`` of this rank."""
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from experiments import ppo_math  # noqa: F401  (registers grpo-math)
    from mfc.ppo_actor import PPOActorInterface
    from parallel.engine import MegatronEngine
    from parallel.groups import ParallelStrategy, build_model_groups
    from parallel.optim import EngineOptimizerConfig
    from realflow.api.batch import MicroBatchSpec, SequenceBatch
    from realflow.api.experiment import experiment_registry
    from realflow.api.interface import Model
    from realflow.api.keys import PROMPTS, REWARDS
    from realflow.config.cli import parse_overrides

    c = parse_overrides(experiment_registry.get("grpo-math"), [])
    ckpt = os.path.join(fileroot, "sft", "trial0", "checkpoints", "default", "final")
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=rank, world_size=dp)
    eng = MegatronEngine(ckpt, build_model_groups(list(range(dp)), ParallelStrategy(dp=dp)), ckpt,
                         EngineOptimizerConfig.for_run(c.actor_optimizer, 1000), seed=1, training=c.training)
    tok = AutoTokenizer.from_pretrained(ckpt)
    iface = PPOActorInterface(**c.ppo.actor_args(), n_samples=c.ppo.n_samples, seed=1)
    n = c.ppo.n_samples
    data = sorted(glob.glob(os.path.join(fileroot, "data", "*-rl-*", "train.jsonl")))[0]
    with open(data) as f:
        rows = [json.loads(line) for line in f][:4000]
    rng = random.Random(seed * 1000 + rank)  # each dp rank its own prompts

    model = Model("actor", eng, tok, 0)

    def batch() -> SequenceBatch:
        picked = rng.sample(rows, groups)
        prompts = SequenceBatch.from_samples([r["id"] for r in picked],
                                             {PROMPTS: [torch.tensor(tok(r["prompt"])["input_ids"]) for r in picked]})
        b = iface.generate(model, prompts, MicroBatchSpec())  # the SFT start's own samples
        b.data[REWARDS] = torch.tensor([float(rng.random() < 0.7) for _ in range(groups * n)])
        b.seqlens[REWARDS] = [[1] * n for _ in range(groups)]
        return b

    spec = MicroBatchSpec(max_tokens_per_mb=c.max_tokens_per_mb)
    return iface, model, spec, batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=1, help="data-parallel ranks (processes; rank 0 reports)")
    ap.add_argument("--fileroot", default="/tmp/bench_root")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--groups", type=int, default=32, help="prompts on this rank (default run: 64 over d2)")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--torch-profile", action="store_true")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    store = tempfile.mkdtemp(prefix="rf_prof_")
    try:
        if a.dp == 1:
            run(0, a, store)
        else:
            import torch.multiprocessing as mp

            mp.spawn(run, args=(a, store), nprocs=a.dp)
    finally:
        shutil.rmtree(store, ignore_errors=True)


def run(rank: int, a: argparse.Namespace, store: str) -> None:
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(a.threads)
    iface, model, spec, make_batch = build(a.fileroot, a.groups, store, rank=rank, dp=a.dp)
    if rank:  # the other ranks follow rank 0's steps (the collectives keep them in step)
        a.cprofile = a.torch_profile = False
    batches = [make_batch() for _ in range(a.steps + 1)]
    iface.train_step(model, batches[0], spec)  # warm-up
    times = []
    out = {}
    if a.cprofile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
    tp = None
    if a.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        tp = profile(activities=[ProfilerActivity.CPU], record_shapes=False)
        tp.__enter__()
    cpu = time.process_time()
    for b in batches[1:]:
        t0 = time.perf_counter()
        out = iface.train_step(model, b, spec)
        times.append(time.perf_counter() - t0)
    cpu = (time.process_time() - cpu) / len(times)
    if tp is not None:
        tp.__exit__(None, None, None)
        print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top))
    if a.cprofile:
        prof.disable()
        st = pstats.Stats(prof)
        st.sort_stats("cumulative").print_stats(a.top)
        st.sort_stats("tottime").print_stats(a.top)
    if a.dp > 1:  # a rank that computes less waits for the others in the collectives
        sys.stdout.write(f"rank {rank}: {1000 * statistics.mean(times):.1f} ms per step, "
                         f"{1000 * cpu:.1f} ms of it on the CPU\n")
        sys.stdout.flush()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if rank:
        return
    print(f"train_step: {1000 * statistics.mean(times):.1f} ms mean, {1000 * min(times):.1f} ms min over "
          f"{len(times)} steps (dp {a.dp}, {a.threads} thread(s) each); loss {out.get('loss'):.6g}, grad_norm "
          f"{out.get('grad_norm'):.6g}, tokens {out.get('n_tokens'):.0f} computed {out.get('n_computed_tokens'):.0f}")


if __name__ == "__main__":
    main()
