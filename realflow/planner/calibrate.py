"""Measure a :class:`DeviceProfile` on this machine (``realflow calibrate``).

Why measure rather than trust a datasheet: a CPU worker's FLOP/s depends on its cores,
threads and vector units, and a GPU's on clocks, drivers and kernels; the planner's
predictions are only as good as these numbers. Each operator a step is made of is timed
at several shapes and a line ``t = overhead + work / rate`` is fitted, so both the fixed
cost (launch / dispatch) and the sustained rate come out. Conventions match
:mod:`realflow.planner.cost`, which turns the numbers back into seconds:

* GEMM: ``2*m*k*n`` FLOPs; ``matmul_overhead_s`` per call.
* attention: causal ``scaled_dot_product_attention``, forward ``2*b*h*s^2*d`` FLOPs (half
  of ``4*b*h*s^2*d``), forward+backward 3.5x that. The fwd+bwd fit's intercept is split
  over the 3 calls the cost model charges a training layer (forward and two backward).
* memcpy: bytes read + written; ``host_bandwidth`` is bytes moved (a pinned host<->device
  copy on a GPU, a host memcpy, i.e. half the read+written rate, on a CPU).
* decode: a plain-torch decoder layer at small batch and 2-3 hidden sizes, against what the
  cost model's decode step charges for it (its roofline: the larger of its FLOPs at
  ``matmul_flops`` and its weights + KV cache read at ``memory_bandwidth``):
  ``decode_layer_overhead_s`` is the smallest excess (the fixed cost shows at small sizes,
  where the roofline is nothing); how far the larger sizes run beyond their roofline
  (small-batch GEMMs on a CPU run well below memcpy bandwidth) is written into ``source``.
* links: ``world`` processes on loopback (gloo; nccl on GPUs), 4 KiB to 16 MiB. All-reduce
  fitted to the ring ``2(n-1)*alpha + 2(n-1)/n * bytes / bandwidth`` gives ``intra_node``;
  all-gather to ``(n-1)*alpha + (n-1)/n * bytes / bandwidth`` (bytes gathered) and a
  send/recv ping-pong to ``alpha + bytes / bandwidth`` give ``intra_node_all_gather`` and
  ``intra_node_p2p``.

Every timing is a warm-up, then the median of a few samples, each a loop of calls long
enough for ``time.perf_counter`` (with a CUDA synchronize on a GPU).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import platform
import shutil
import socket
import statistics
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from realflow.planner.profile import DeviceProfile, LinkProfile

KiB, MiB = 1 << 10, 1 << 20


class CalibrationError(RuntimeError):
    """A measurement that failed or makes no sense; the message says which."""


def fit_line(x: Sequence[float], t: Sequence[float], what: str) -> tuple[float, float]:
    """``(a, b)`` of ``t = a + b*x``, least squares on relative error (so the small shapes
    set the intercept and the large ones the slope); ``a`` is clamped at 0 (refit through 0)."""
    x, t = np.asarray(x, float), np.asarray(t, float)
    if len(x) < 2 or np.any(t <= 0):
        raise CalibrationError(f"{what}: need >= 2 positive timings, got {t.tolist()}")
    a, b = np.linalg.lstsq(np.stack([1 / t, x / t], 1), np.ones_like(t), rcond=None)[0]
    if a < 0:
        a, b = 0.0, float(np.sum(x / t) / np.sum(x * x / (t * t)))
    if not b > 0:
        raise CalibrationError(f"{what}: time does not grow with size ({list(zip(x.tolist(), t.tolist()))})")
    return float(a), float(b)


def bench(fn: Callable[[], object], sync: Callable[[], None], target_s: float, samples: int) -> float:
    """Median seconds per call of ``fn``: one warm-up call, then ``samples`` loops of calls
    that each last about ``target_s`` (so the timer and sync cost nothing per call)."""
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    inner = int(min(max(target_s / max(time.perf_counter() - t0, 1e-9), 1), 20000))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _measure_local(torch, gpu: bool, quick: bool) -> dict[str, float]:
    """Everything but the links, in this process, on the current device."""
    import torch.nn.functional as F

    dev = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    dt = torch.bfloat16 if gpu else torch.float32
    esize = 2 if gpu else 4
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    target, samples = (0.01, 3) if quick else (0.1, 7)
    g = 8 if gpu else 1  # GPUs need larger shapes to reach their sustained rate

    def run(fn):
        return bench(fn, sync, target, samples)

    out: dict[str, float] = {}
    # GEMMs (m tokens x k in -> n out)
    shapes = [(16, 64, 64), (128, 256, 256), (512, 512, 512), (512, 1024, 1024)]
    if not quick:
        shapes += [(64, 128, 128), (256, 256, 1024), (1024, 1024, 1024)]
    flops, times = [], []
    for m, k, n in shapes:
        a = torch.randn(m * g, k * g, device=dev, dtype=dt)
        b = torch.randn(k * g, n * g, device=dev, dtype=dt)
        flops.append(2.0 * m * k * n * g ** 3)
        times.append(run(lambda: torch.matmul(a, b)))
    out["matmul_overhead_s"], inv = fit_line(flops, times, "matmul")
    out["matmul_flops"] = 1 / inv
    # causal attention forward + backward (b, h, s, d)
    shapes = [(1, 2, 64, 32), (1, 4, 128, 64), (2, 4, 256, 64), (1, 8, 512, 64)]
    if not quick:
        shapes += [(1, 8, 1024, 64)]
    if gpu:
        shapes = [(1, 8, 256, 64), (4, 16, 1024, 128), (2, 16, 2048, 128), (1, 16, 4096, 128)]
        shapes += [] if quick else [(1, 32, 8192, 128)]
    flops, times = [], []
    for b, h, s, d in shapes:
        q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, s, d, device=dev, dtype=dt)

        def fwd_bwd(q=q, k=k, v=v, grad=grad):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return torch.autograd.grad(o, (q, k, v), grad)

        flops.append(3.5 * 2.0 * b * h * s * s * d)
        times.append(run(fwd_bwd))
    intercept, inv = fit_line(flops, times, "attention")
    out["attention_overhead_s"], out["attention_flops"] = intercept / 3, 1 / inv
    # memcpy (read + written), beyond the caches
    sizes = [32 * MiB, 128 * MiB] if quick else [32 * MiB, 64 * MiB, 128 * MiB, 256 * MiB]
    sizes = [s * (4 if gpu else 1) for s in sizes]
    times = []
    for size in sizes:
        src = torch.empty(size, dtype=torch.uint8, device=dev).fill_(1)
        times.append(run(lambda s=src, d=torch.empty_like(src): d.copy_(s)))
        src = None
    _, inv = fit_line([2.0 * s for s in sizes], times, "memcpy")
    out["memory_bandwidth"] = 1 / inv
    out["host_bandwidth"] = out["memory_bandwidth"] / 2
    if gpu:  # pinned host <-> device, both directions
        host = torch.empty(256 * MiB, dtype=torch.uint8, pin_memory=True)
        buf = torch.empty(256 * MiB, dtype=torch.uint8, device=dev)
        t = run(lambda: buf.copy_(host, non_blocking=True)) + run(lambda: host.copy_(buf, non_blocking=True))
        out["host_bandwidth"] = 2 * 256 * MiB / t
    # one small elementwise op (allocating its output, as model code does)
    x = torch.ones(16, device=dev, dtype=dt)
    out["op_overhead_s"] = run(lambda: torch.mul(x, 2.0))
    # decode: one plain decoder layer, one new token per sequence over a KV cache
    batch, kv, hd = (8, 512, 128) if gpu else (4, 128, 64)
    hiddens = [1024, 2048, 4096] if gpu else [64, 256, 1024]
    runs = [_decode_layer(torch, F, dev, dt, esize, batch, h, kv, hd, out, run) for h in hiddens[::2 if quick else 1]]
    out["decode_layer_overhead_s"] = fixed = max(0.0, min(m - p for m, p in runs))
    out["decode_vs_roofline"] = max((m - fixed) / p for m, p in runs)
    return out


def _decode_layer(torch, F, dev, dt, esize, batch, hidden, kv, hd, fitted, run) -> tuple[float, float]:
    """(measured, cost-model) seconds of one decode step of one layer."""
    heads, ffn = hidden // hd, (8 * hidden // 3 + 63) // 64 * 64

    def w(i, o):
        return torch.randn(i, o, device=dev, dtype=dt) / i ** 0.5

    wqkv, wo, wgu, wd = w(hidden, 3 * hidden), w(hidden, hidden), w(hidden, 2 * ffn), w(ffn, hidden)
    n1, n2 = torch.ones(hidden, device=dev, dtype=dt), torch.ones(hidden, device=dev, dtype=dt)
    kc, vc = (torch.randn(batch, heads, kv + 1, hd, device=dev, dtype=dt) for _ in range(2))
    x0 = torch.randn(batch, 1, hidden, device=dev, dtype=dt)

    @torch.inference_mode()
    def step():
        h = F.rms_norm(x0, (hidden,), n1)
        q, k, v = (h @ wqkv).view(batch, 1, 3, heads, hd).permute(2, 0, 3, 1, 4)
        kc[:, :, kv:kv + 1] = k
        vc[:, :, kv:kv + 1] = v
        a = F.scaled_dot_product_attention(q, kc, vc).transpose(1, 2).reshape(batch, 1, hidden)
        x = x0 + a @ wo
        gate, up = (F.rms_norm(x, (hidden,), n2) @ wgu).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ wd

    params = 4 * hidden * hidden + 3 * ffn * hidden + 2 * hidden
    flops = 2.0 * batch * params + 4.0 * batch * (kv + 1) * hidden
    nbytes = params * esize + 2.0 * batch * (kv + 1) * hidden * esize
    predicted = max(flops / fitted["matmul_flops"], nbytes / fitted["memory_bandwidth"])
    return run(step), predicted


def _collective_worker(rank: int, world: int, tmp: str, quick: bool, threads: int) -> None:
    """One rank of the link measurement; writes ``result.<rank>.json`` ({ok, error | data})
    and keeps its current stage in ``progress.<rank>`` (for the parent's timeout message)."""
    progress = Path(tmp, f"progress.{rank}")
    progress.write_text("import torch")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    gpu = torch.cuda.is_available()
    try:
        progress.write_text("init_process_group")
        if gpu:
            torch.cuda.set_device(rank)
        else:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("nccl" if gpu else "gloo", init_method=f"file://{tmp}/store", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        dev = torch.device("cuda", rank) if gpu else torch.device("cpu")
        sync = torch.cuda.synchronize if gpu else (lambda: None)
        sizes = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB] if quick else [4 * KiB << 2 * i for i in range(7)]
        data: dict[str, list] = {"all_reduce": [], "all_gather": [], "p2p": []}
        for op in data:
            for size in sizes:
                progress.write_text(f"{op} of {size} bytes")
                buf = torch.ones(size // 4, dtype=torch.float32, device=dev)
                part = buf[: size // 4 // world]
                parts = [torch.empty_like(part) for _ in range(world)]
                inner = max(1, min(20 if quick else 50, 4 * MiB // size))  # the same on all ranks

                def once():
                    if op == "all_reduce":
                        dist.all_reduce(buf)
                    elif op == "all_gather":
                        dist.all_gather(parts, part)
                    elif rank < 2:  # ping-pong between ranks 0 and 1: half a round trip
                        for send in ((True, False) if rank == 0 else (False, True)):
                            (dist.send if send else dist.recv)(buf, 1 - rank)

                once()
                ts = []
                for _ in range(3 if quick else 7):
                    dist.barrier()
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(inner):
                        once()
                    sync()
                    ts.append((time.perf_counter() - t0) / inner / (2 if op == "p2p" else 1))
                data[op].append([part.numel() * 4 * world if op == "all_gather" else size, statistics.median(ts)])
        dist.barrier()
        dist.destroy_process_group()
        result = {"ok": True, "data": data}
    except Exception as e:  # noqa: BLE001 - reported to the parent with the stage it failed in
        result = {"ok": False, "error": f"rank {rank} in {progress.read_text()!r}: {type(e).__name__}: {e}"}
    Path(tmp, f"result.{rank}.json").write_text(json.dumps(result))
    progress.write_text("<done>")


def measure_links(world: int, quick: bool, threads: int = 1, timeout_s: float = 150.0) -> dict[str, LinkProfile]:
    """Fitted ``all_reduce`` / ``all_gather`` / ``p2p`` links between ``world`` local processes.

    On a CPU the ranks are forked from this process (no second torch import: seconds on a
    busy machine); CUDA cannot be forked, so on a GPU they are spawned."""
    import torch

    if world < 2:
        raise CalibrationError(f"measuring links needs world >= 2 processes, got {world}")
    tmp = tempfile.mkdtemp(prefix="rf_calibrate_")
    ctx = multiprocessing.get_context("spawn" if torch.cuda.is_available() else "fork")
    procs = [ctx.Process(target=_collective_worker, args=(r, world, tmp, quick, threads), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    errors, data = [], {}
    for r, p in enumerate(procs):
        p.join(max(deadline - time.monotonic(), 0.1))
        if p.is_alive():
            p.kill()
            p.join()
            where = Path(tmp, f"progress.{r}")
            errors.append(f"rank {r} timed out after {timeout_s:g}s in "
                          f"{where.read_text() if where.exists() else 'startup'!r}")
            continue
        path = Path(tmp, f"result.{r}.json")
        res = json.loads(path.read_text()) if path.exists() else \
            {"ok": False, "error": f"rank {r} left no result (exit code {p.exitcode})"}
        if not res["ok"]:
            errors.append(res["error"])
        data = data or res.get("data", {})
    shutil.rmtree(tmp, ignore_errors=True)
    if errors:
        raise CalibrationError(f"link measurement over {world} local processes failed:\n" + "\n".join(errors))
    links = {}
    for op, steps, share in (("all_reduce", 2 * (world - 1), 2 * (world - 1) / world),
                             ("all_gather", world - 1, (world - 1) / world), ("p2p", 1, 1.0)):
        a, b = fit_line([n for n, _ in data[op]], [t for _, t in data[op]], op)
        links[op] = LinkProfile(alpha_s=a / steps, bandwidth=share / b)
    return links


def calibrate(threads: int = 1, quick: bool = False, world: int = 2) -> DeviceProfile:
    """Measure this machine: the current GPU (bf16) if CUDA is available, else one CPU worker
    process with ``threads`` threads (fp32); links between ``world`` local processes."""
    import torch

    if world < 2 and not torch.cuda.is_available():
        raise CalibrationError(f"world={world}: the links need >= 2 worker processes")
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gpu = torch.cuda.is_available()
        local = _measure_local(torch, gpu, quick)
    finally:
        torch.set_num_threads(old_threads)
    if gpu:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        device, memory = props.name, int(props.total_memory)
        world = min(world, torch.cuda.device_count())
    else:
        device = _cpu_model()
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(world, 1)  # MemTotal / workers
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    source = (f"measured: {socket.gethostname()}, {device}, torch {torch.__version__}, threads={threads}, "
              f"{when}{', quick' if quick else ''}")
    source += f"; decode layer up to {local.pop('decode_vs_roofline'):.2g}x its roofline"
    if world >= 2:
        links = measure_links(world, quick, threads)
        source += f"; links over {world} processes ({'nccl' if gpu else 'gloo'}, loopback)"
        extra = {"intra_node": links["all_reduce"], "intra_node_all_gather": links["all_gather"],
                 "intra_node_p2p": links["p2p"]}
    else:
        source += "; links not measured (one GPU): intra_node is the default"
        extra = {}
    name = device if gpu else f"cpu ({device}, {threads} thread{'s' if threads > 1 else ''})"
    prof = DeviceProfile(name=name, source=source, memory_bytes=memory, params_bytes=2 if gpu else 4, packed_attention=gpu,
                         **local, **extra)
    prof.validate()
    return prof
