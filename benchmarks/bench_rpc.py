"""Control-plane round trip: raw ZMQ DEALER/ROUTER vs realflow's signed MasterEndpoint/WorkerEndpoint.

One command:  python benchmarks/bench_rpc.py [--n 2000] [--rounds 5]

Both peers of each pair are separate processes on 127.0.0.1 (master side = this
process). Baseline: a ROUTER sends an empty frame to a DEALER in another process
that echoes it straight back (no codec, no MAC, no Python dispatch beyond
recv/send). Ours: ``MasterEndpoint.call(worker, "noop", None)`` answered by
``WorkerEndpoint.serve`` (msgpack codec, keyed-BLAKE2b MAC both ways, replay check,
deadline check, handler dispatch). Rounds alternate between the two so that
machine noise hits both alike; the median round is reported.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

import zmq

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from realflow.comm.auth import SECRET_ENV, new_secret, secret_from_env, secret_to_hex  # noqa: E402
from realflow.comm.rpc import MasterEndpoint, WorkerEndpoint  # noqa: E402


def raw_echo(address: str) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"raw")
    sock.setsockopt(zmq.RCVTIMEO, 60_000)  # blocking recv with a timeout: the leanest possible loop
    sock.connect(address)
    sock.send(b"hello")
    while True:
        try:
            msg = sock.recv_multipart()
        except zmq.Again:
            return
        if msg == [b"stop"]:
            return
        sock.send_multipart(msg)


def ours_serve(address: str) -> None:
    stop = threading.Event()
    with WorkerEndpoint("w", address, secret_from_env()) as w:
        w.serve({"noop": lambda p: None, "stop": lambda p: stop.set()}, stop, poll_interval=1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1000, help="round trips per round")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--role", choices=["raw", "ours"], help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "raw":
        return raw_echo(args.address)
    if args.role == "ours":
        return ours_serve(args.address)

    secret = new_secret()
    env = dict(os.environ, **{SECRET_ENV: secret_to_hex(secret)})
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVTIMEO, 60_000)
    router.bind("tcp://127.0.0.1:*")
    raw_addr = router.getsockopt_string(zmq.LAST_ENDPOINT)
    master = MasterEndpoint(secret)
    me = os.path.abspath(__file__)
    procs = [subprocess.Popen([sys.executable, me, "--role", "raw", "--address", raw_addr], env=env),
             subprocess.Popen([sys.executable, me, "--role", "ours", "--address", master.address], env=env)]
    try:
        assert router.recv_multipart() == [b"raw", b"hello"], "raw echo process did not connect"
        router.setsockopt(zmq.RCVTIMEO, 10_000)
        master.wait_for_workers(["w"], timeout=60)

        def raw_round(n: int) -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                router.send_multipart([b"raw", b""])
                router.recv_multipart()  # raises zmq.Again after 10 s
            return (time.perf_counter() - t0) / n

        def ours_round(n: int) -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                master.call("w", "noop", None, timeout=10)
            return (time.perf_counter() - t0) / n

        raw_round(200), ours_round(200)  # warm up
        raw_t, ours_t = [], []
        for _ in range(args.rounds):
            raw_t.append(raw_round(args.n))
            ours_t.append(ours_round(args.n))
        raw_us, ours_us = statistics.median(raw_t) * 1e6, statistics.median(ours_t) * 1e6
        print(f"round trip, empty payload, {args.rounds} rounds x {args.n} calls, two processes on 127.0.0.1")
        print("  baseline = raw ZMQ ROUTER -> DEALER echo -> ROUTER (bytes only: no codec, no MAC, no dispatch)")
        print(f"  raw ZMQ DEALER/ROUTER     : {raw_us:8.1f} us/round trip  (rounds: "
              f"{', '.join(f'{t * 1e6:.1f}' for t in raw_t)})")
        print(f"  realflow Master/Worker rpc: {ours_us:8.1f} us/round trip  (rounds: "
              f"{', '.join(f'{t * 1e6:.1f}' for t in ours_t)})")
        print(f"  ratio ours/raw latency    : {ours_us / raw_us:8.2f}x   (overhead {ours_us - raw_us:.1f} us; "
              f"throughput {1e6 / ours_us:.0f} vs {1e6 / raw_us:.0f} calls/s)")
    finally:
        try:
            router.send_multipart([b"raw", b"stop"])
            master.request("w", "stop", None, timeout=5)
        except Exception:  # noqa: BLE001 - best effort; processes are killed below anyway
            pass
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        master.close()
        router.close()


if __name__ == "__main__":
    main()
