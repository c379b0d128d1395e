"""Worker -> worker tensor transfer through shared memory vs an in-process memcpy, same run.

One command:  python benchmarks/bench_transfer.py [--mib 64] [--iters 10]

Setup: this process is the producer (it also plays the master that sends the
control message); a second process is the consumer (a ``WorkerEndpoint``). The
batch is a dict of tensors (int64 token ids, fp32 logprobs, bf16 values, fp32
rewards) of --mib MiB in total.

Measured per transfer (CLOCK_MONOTONIC is shared by all processes of a host):
  t0  producer starts ``shm.put_tensors(batch)``
  ... producer sends the handle in a signed request (the small control message)
  t1  consumer's ``shm.take_tensors(handle)`` returned: it holds usable tensors
  t2  consumer has touched every page of them (first-access page faults paid)
transfer time = t1 - t0 (headline) and t2 - t0 (stricter). Two producer modes:
  fresh   a new /dev/shm segment per transfer (pages faulted and zeroed on write)
  pooled  ``shm.ShmPool``: a pre-faulted segment, refilled in the background
          between transfers (we wait for the refill before the next transfer)

Baseline (memcpy): in the producer process, ``dst.copy_(src)`` of one contiguous
--mib MiB uint8 tensor into a preallocated, already-touched tensor of the same
size; single thread (torch.set_num_threads(1)) like the transfer; measured in the
same iterations, interleaved with the transfers.
Ratio = transfer bandwidth / memcpy bandwidth (goal >= 50%).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import threading
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from realflow.comm import shm  # noqa: E402
from realflow.comm.auth import SECRET_ENV, new_secret, secret_from_env, secret_to_hex  # noqa: E402
from realflow.comm.rpc import MasterEndpoint, WorkerEndpoint  # noqa: E402

PAGE = 4096


def make_batch(mib: int) -> dict[str, torch.Tensor]:
    quarter = (mib << 20) // 4
    g = torch.Generator().manual_seed(0)
    return {
        "packed_input_ids": torch.randint(0, 150_000, (quarter // 8,), dtype=torch.int64, generator=g),
        "logprobs": torch.randn(quarter // 4, generator=g),
        "values": torch.randn(quarter // 2, generator=g).bfloat16(),
        "rewards": torch.randn(quarter // 4, generator=g),
    }


def digest(ts: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(ts):
        h.update(k.encode())
        h.update(str(ts[k].dtype).encode())
        h.update(ts[k].contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def consumer(address: str) -> None:
    torch.set_num_threads(1)
    stop = threading.Event()

    def take(handle: dict) -> dict:
        tensors = shm.take_tensors(handle)
        t1 = time.monotonic_ns()
        for t in tensors.values():  # touch one byte per page: what the first real use pays extra
            raw = t.view(-1).view(torch.uint8)
            raw[::PAGE].sum()
        t2 = time.monotonic_ns()
        return {"t1": t1, "t2": t2}

    def verify(handle: dict) -> str:
        return digest(shm.take_tensors(handle))

    with WorkerEndpoint("consumer", address, secret_from_env()) as w:
        w.serve({"take": take, "verify": verify, "stop": lambda p: stop.set()}, stop)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--consumer", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.consumer:
        return consumer(args.consumer)

    torch.set_num_threads(1)
    secret = new_secret()
    prefix = shm.segment_prefix("bench", str(os.getpid()))
    master = MasterEndpoint(secret)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--consumer", master.address],
                            env=dict(os.environ, **{SECRET_ENV: secret_to_hex(secret)}))
    pool = shm.ShmPool(prefix, max_bytes=4 * (args.mib << 20))
    try:
        master.wait_for_workers(["consumer"], timeout=120)
        batch = make_batch(args.mib)
        nbytes = sum(t.numel() * t.element_size() for t in batch.values())
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)  # touch the destination once: "preallocated"

        # correctness first (outside timing): bit-exact across processes, both modes
        assert master.call("consumer", "verify", shm.put_tensors(batch, prefix=prefix), 120) == digest(batch)
        assert master.call("consumer", "verify", pool.put_tensors(batch), 120) == digest(batch)

        def transfer(put) -> tuple[float, float]:
            t0 = time.monotonic_ns()
            handle = put(batch)
            r = master.call("consumer", "take", handle, timeout=60)
            return (r["t1"] - t0) / 1e9, (r["t2"] - t0) / 1e9

        def memcpy() -> float:
            t0 = time.perf_counter()
            dst.copy_(src)
            return time.perf_counter() - t0

        master.call("consumer", "take", shm.put_tensors(batch, prefix=prefix), 60)  # warm-up
        res: dict[str, list[float]] = {k: [] for k in ["memcpy", "fresh", "fresh_touched", "pooled", "pooled_touched"]}
        for _ in range(args.iters):
            res["memcpy"].append(memcpy())
            a, b = transfer(lambda ts: shm.put_tensors(ts, prefix=prefix))
            res["fresh"].append(a)
            res["fresh_touched"].append(b)
            assert pool.wait_idle(60), "pool refill did not finish"
            a, b = transfer(pool.put_tensors)
            res["pooled"].append(a)
            res["pooled_touched"].append(b)
            res["memcpy"].append(memcpy())
            assert pool.wait_idle(60)
        mib = nbytes / (1 << 20)
        base = statistics.median(res["memcpy"])

        def line(name: str, key: str) -> str:
            med, best = statistics.median(res[key]), min(res[key])
            return (f"  {name:44s} median {med * 1e3:7.2f} ms = {mib / 1024 / med:6.2f} GiB/s "
                    f"(best {best * 1e3:6.2f} ms)   ratio vs memcpy {base / med * 100:5.1f}%")

        print(f"transfer of a {mib:.0f} MiB batch ({len(batch)} tensors: int64/fp32/bf16/fp32) producer -> consumer "
              f"process, {args.iters} iterations, pool hits {pool.hits}")
        print("  baseline = memcpy: torch dst.copy_(src) of one contiguous {:.0f} MiB uint8 tensor into a "
              "preallocated, already-touched tensor, 1 thread, in the producer process, same run".format(mib))
        print(f"  {'memcpy baseline':44s} median {base * 1e3:7.2f} ms = {mib / 1024 / base:6.2f} GiB/s "
              f"(best {min(res['memcpy']) * 1e3:6.2f} ms)")
        print(line("shm pooled: put + control msg + take", "pooled"))
        print(line("shm pooled, consumer touched every page", "pooled_touched"))
        print(line("shm fresh segment: put + control msg + take", "fresh"))
        print(line("shm fresh, consumer touched every page", "fresh_touched"))
        print("  (transfer = from the producer starting put_tensors until take_tensors returned in the consumer, "
              "incl. the signed control message)")
    finally:
        try:
            master.request("consumer", "stop", None, timeout=5)
        except Exception:  # noqa: BLE001 - best effort; the process is killed below anyway
            pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        pool.close()
        master.close()
        leaked = shm.cleanup_segments(prefix)
        if leaked:
            print(f"WARNING: {len(leaked)} segment(s) leaked and removed: {leaked}")


if __name__ == "__main__":
    main()
