"""Parameter reallocation t2p2 <-> d4 on 4 processes of one host, against baselines from the same run.

One command:  python benchmarks/bench_realloc.py [--iters 3] [--dtype float32] [--layers 12]

Model: a Qwen2 config (hidden 768, 12 layers, 12 heads, intermediate 3072, vocab
32000, untied LM head): about 162M parameters (650 MB in fp32).  To keep the run short the
parameters are NOT megatron modules: each process allocates its local tensors
directly from the shard spec (``parallel.realloc.allocate_shards``: the same names
and shapes a GPTModel stage has) and fills them from seeded full tensors.

Measured, each direction (t2p2 -> d4: every rank receives the whole model;
d4 -> t2p2: every rank keeps its shard, all local copies):
  time       wall seconds of one ``reallocate`` call (median of --iters, slowest rank)
  effective  bytes written into destination parameters / time
  memcpy     aggregate bandwidth of 4 processes each doing ``dst.copy_(src)`` on
             preallocated, touched buffers at the same time (single thread each,
             like the reallocation), measured in the same run
  naive      gather-to-one-rank-then-broadcast through torch.distributed (gloo): per
             parameter, tp shards are sent to rank 0, rank 0 assembles the full tensor
             and broadcasts it, every rank cuts its destination shard
  RSS        peak resident set (ru_maxrss) per process; shared-memory pages a
             process touched count in its RSS
Goals: effective >= 50% of memcpy; >= 3x faster than naive.  The result is
checked bit-exact (torch.equal) against the reference shards after the timed runs.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

WORLD = 4
CONFIG = dict(model_type="qwen2", vocab_size=32000, hidden_size=768, intermediate_size=3072,
              num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
              max_position_embeddings=2048, tie_word_embeddings=False, hidden_act="silu",
              rms_norm_eps=1e-6, rope_theta=10000.0)


def _full(name: str, shape, dtype):
    import torch

    g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 + len(name))
    return torch.randn(shape, generator=g).to(dtype)


def _fill(tensors, shards, table, dtype) -> None:
    from parallel.realloc import reference_shard

    shapes = {e.mcore_name: e.mcore_shape for e in table}
    for n, s in shards.items():
        tensors[s.local_name].copy_(reference_shard(s, _full(n, shapes[n], dtype)))


def _verify(tensors, shards, table, dtype) -> bool:
    import torch

    from parallel.realloc import reference_shard

    shapes = {e.mcore_name: e.mcore_shape for e in table}
    return all(torch.equal(tensors[s.local_name], reference_shard(s, _full(n, shapes[n], dtype)))
               for n, s in shards.items())


def _naive(src_layout, dst_layout, src_t, dst_t, src_shards, dst_shards, table, arch_src, dtype) -> None:
    """Gather every parameter to rank 0, broadcast it, cut the destination shard."""
    import torch
    import torch.distributed as dist

    from parallel.realloc import reference_shard

    me = dist.get_rank()
    for e in table:
        full = torch.empty(e.mcore_shape, dtype=dtype)
        for tp in range(src_layout.strategy.tp):  # the tp shards of replica 0 (and the stage holding e)
            owners = [r for r in src_layout.workers if e.mcore_name in src_shards[r]
                      and src_layout.coords(r)[0] == 0 and src_layout.coords(r)[1] == tp]
            owner = owners[0]
            s = src_shards[owner][e.mcore_name]
            buf = src_t[s.local_name] if me == owner else torch.empty(s.local_shape, dtype=dtype)
            if owner != 0:
                if me == owner:
                    dist.send(buf.contiguous(), 0)
                elif me == 0:
                    dist.recv(buf, owner)
            if me == 0:
                for p in s.pieces:
                    full.narrow(s.dim, p.lo, p.size).copy_(buf.narrow(s.dim, p.local_lo, p.size))
        dist.broadcast(full, 0)
        if e.mcore_name in dst_shards.get(me, {}):
            s = dst_shards[me][e.mcore_name]
            dst_t[s.local_name].copy_(reference_shard(s, full))


def worker(rank: int, store_path: str, out: str, iters: int, dtype_name: str, layers: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store_path, rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=600))
    from parallel.groups import ParallelStrategy
    from parallel.hf_io import param_table
    from parallel.model_config import hf_arch
    from parallel.realloc import (allocate_shards, gather_hosts, plan_reallocation,
                                  prepare_reallocation, reallocate)
    from parallel.realloc.sync import default_store, store_barrier
    from realflow.api.layout import Layout

    dtype = getattr(torch, dtype_name)
    cfg = dict(CONFIG, num_hidden_layers=layers)
    table = param_table(cfg, hf_arch(cfg))
    counter = {"n": 0}

    def barrier():
        counter["n"] += 1
        store_barrier(default_store(), f"bench/{counter['n']}", range(WORLD), b"", 600, "bench")

    ranks = tuple(range(WORLD))
    t2p2 = Layout(ranks, ParallelStrategy(1, 2, 2))
    d4 = Layout(ranks, ParallelStrategy(4, 1, 1))
    hosts = gather_hosts()
    res_out: dict = {"rank": rank}
    t0 = time.perf_counter()
    fwd = plan_reallocation(cfg, t2p2, d4, dtype, hosts=hosts)
    bwd = plan_reallocation(cfg, d4, t2p2, dtype, hosts=hosts)
    res_out["plan_seconds"] = (time.perf_counter() - t0) / 2
    a = allocate_shards(fwd.src_shards[rank], dtype)
    b = allocate_shards(fwd.dst_shards[rank], dtype)
    _fill(a, fwd.src_shards[rank], table, dtype)
    for t in b.values():
        t.fill_(1.0)  # touched, like live parameters
    t0 = time.perf_counter()
    rf, rb = prepare_reallocation(fwd), prepare_reallocation(bwd)
    res_out["prepare_seconds"] = time.perf_counter() - t0

    def bytes_of(shards):
        return sum(t.numel() * t.element_size() for t in allocate_shards(shards, dtype, "meta").values())

    res_out["params_total"] = sum(math_prod(e.mcore_shape) for e in table)
    res_out["dst_bytes_fwd"] = bytes_of(fwd.dst_shards[rank])
    res_out["dst_bytes_bwd"] = bytes_of(bwd.dst_shards[rank])
    res_out["src_bytes"] = bytes_of(fwd.src_shards[rank])
    # memcpy baseline, interleaved with the reallocations (the host is shared: load drifts):
    # each process copies as many bytes as it receives in t2p2 -> d4, all at the same time.
    runs = (("t2p2->d4", fwd, rf, a, b), ("d4->t2p2", bwd, rb, b, a))
    for _, plan, res, s_mod, d_mod in runs:
        reallocate(plan, res, s_mod, d_mod)  # warm-up
    res_out["rss_after_realloc_MiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    msrc = torch.ones(res_out["dst_bytes_fwd"], dtype=torch.uint8)
    mdst = torch.zeros_like(msrc)
    mdst.copy_(msrc)
    times: dict[str, list[float]] = {"memcpy": [], **{r[0]: [] for r in runs}}
    for _ in range(iters):
        barrier()
        t0 = time.perf_counter()
        mdst.copy_(msrc)
        barrier()
        times["memcpy"].append(time.perf_counter() - t0)
        for label, plan, res, s_mod, d_mod in runs:
            barrier()
            t0 = time.perf_counter()
            res_out[f"stats {label}"] = reallocate(plan, res, s_mod, d_mod)
            times[label].append(time.perf_counter() - t0)
    del msrc, mdst
    res_out["memcpy_bytes"] = float(res_out["dst_bytes_fwd"])
    res_out["times"] = times
    res_out["exact d4"] = _verify(b, fwd.dst_shards[rank], table, dtype)
    res_out["exact t2p2"] = _verify(a, fwd.src_shards[rank], table, dtype)
    # naive baseline, both directions
    arch = hf_arch(cfg, tp_size=2)
    for label, plan, s_mod, d_mod in (("t2p2->d4", fwd, a, b), ("d4->t2p2", bwd, b, a)):
        barrier()
        t0 = time.perf_counter()
        _naive(plan.src, plan.dst, s_mod, d_mod, plan.src_shards, plan.dst_shards, table, arch, dtype)
        barrier()
        res_out[f"naive {label}"] = time.perf_counter() - t0
    res_out["rss_peak_MiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rf.close()
    rb.close()
    with open(os.path.join(out, f"r{rank}.json"), "w") as f:
        json.dump(res_out, f)
    dist.destroy_process_group()


def math_prod(shape) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--verbose", action="store_true", help="per-rank byte counts and barrier times")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--store", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, args.store, args.out, args.iters, args.dtype, args.layers)
        return
    tmp = tempfile.mkdtemp(prefix="bench_realloc_")
    atexit.register(shutil.rmtree, tmp, True)  # leave nothing behind in /tmp
    with socket.socket() as sock:  # a free port for the TCPStore (what a real launch uses)
        sock.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(r), "--store", init, "--out", tmp, "--iters", str(args.iters),
                               "--dtype", args.dtype, "--layers", str(args.layers)], env=env)
             for r in range(WORLD)]
    deadline = time.monotonic() + args.timeout
    for r, p in enumerate(procs):
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            sys.exit(f"bench_realloc: rank {r} did not finish within {args.timeout:.0f}s")
    if any(p.returncode for p in procs):
        sys.exit(f"bench_realloc: worker exit codes {[p.returncode for p in procs]}")
    rs = [json.load(open(os.path.join(tmp, f"r{r}.json"))) for r in range(WORLD)]

    def slowest(key):  # per iteration the slowest rank, then the median over iterations
        return statistics.median(max(r["times"][key][i] for r in rs) for i in range(args.iters))

    memcpy_bw = sum(r["memcpy_bytes"] for r in rs) / slowest("memcpy")
    gb = 1e9
    print(f"model: {rs[0]['params_total'] / 1e6:.1f}M parameters, {args.dtype}, "
          f"{sum(r['src_bytes'] for r in rs) / gb:.3f} GB per copy; plan {rs[0]['plan_seconds'] * 1e3:.1f} ms, "
          f"prepare (both plans) {rs[0]['prepare_seconds']:.2f} s")
    print(f"memcpy (4 concurrent processes, 1 thread each, interleaved with the runs): "
          f"{memcpy_bw / gb:.2f} GB/s aggregate; median of {args.iters} iterations, slowest rank")
    ok = True
    for label, key in (("t2p2->d4", "dst_bytes_fwd"), ("d4->t2p2", "dst_bytes_bwd")):
        t = slowest(label)
        naive = max(r[f"naive {label}"] for r in rs)
        eff = sum(r[key] for r in rs) / t
        ratio, speedup = eff / memcpy_bw, naive / t
        ok &= ratio >= 0.5 and speedup >= 3
        print(f"{label}: {t * 1e3:8.1f} ms  effective {eff / gb:6.2f} GB/s = {ratio * 100:5.1f}% of memcpy "
              f"(goal >= 50%)  naive {naive * 1e3:8.1f} ms -> {speedup:5.1f}x faster (goal >= 3x)")
    if args.verbose:
        for r in rs:
            print(r["rank"], {k: v for k, v in r.items() if k.startswith("stats")})
    exact = all(r["exact d4"] and r["exact t2p2"] for r in rs)
    print(f"bit-exact after A->B->A: {exact}")
    print("peak RSS per process (MiB): through the reallocations " +
          ", ".join(f"{r['rss_after_realloc_MiB']:.0f}" for r in rs) +
          "; at the end (incl. memcpy buffers and naive baseline) " + ", ".join(f"{r['rss_peak_MiB']:.0f}" for r in rs))
    print("goals met" if ok and exact else "GOALS NOT MET")


if __name__ == "__main__":
    main()
