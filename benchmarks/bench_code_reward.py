"""Sandboxed code verification throughput: bubblewrap sandbox vs plain subprocess, same programs.

One command:  python benchmarks/bench_code_reward.py [--programs 400] [--pool 8]

Runs the same mix of small model-like programs (correct, wrong, crashing; each reads a
test input from stdin and prints) through :func:`realflow.base.sandbox.run_program` --
once sandboxed, once as plain subprocesses with the same rlimits (the unsandboxed path of
the same runner) -- in a pool of ``--pool`` concurrent runs, alternating twice.  Prints
programs/s of each and the overhead ratio (goal: sandbox <= 2x the plain runs' time).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROGRAMS = [
    "a, b = map(int, input().split())\nprint(a + b)\n",
    "a, b = map(int, input().split())\nprint(a - b)\n",
    "import sys\nnums = [int(x) for x in sys.stdin.read().split()]\nprint(sorted(nums))\n",
    "a, b = map(int, input().split())\nprint(a // (b - b))\n",  # crashes
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\nprint(fib(18))\n",
]


def run_all(n: int, pool: int, sandboxed: bool) -> float:
    from realflow.base import sandbox

    limits = sandbox.SandboxLimits(wall_s=10, cpu_s=5)

    def one(i: int) -> bool:
        return sandbox._run(PROGRAMS[i % len(PROGRAMS)], f"{i} {i % 7 + 1}\n", limits, slot=i % pool,
                            sandboxed=sandboxed).exit_code is not None

    t0 = time.perf_counter()
    with ThreadPoolExecutor(pool) as ex:
        assert all(ex.map(one, range(n)))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", type=int, default=400)
    ap.add_argument("--pool", type=int, default=8)
    a = ap.parse_args()
    from realflow.base.sandbox import sandbox_status

    problem = sandbox_status()
    if problem:
        sys.exit(f"no sandbox: {problem}")
    run_all(a.pool, a.pool, True)  # warm-up
    box, plain = [], []
    for _ in range(2):
        box.append(run_all(a.programs, a.pool, True))
        plain.append(run_all(a.programs, a.pool, False))
    t_box, t_plain = min(box), min(plain)
    print(f"{a.programs} programs, {a.pool} at a time, {os.cpu_count()} cores")
    print(f"sandboxed (bubblewrap + rlimits): {a.programs / t_box:7.1f} programs/s")
    print(f"plain subprocess (rlimits only) : {a.programs / t_plain:7.1f} programs/s")
    print(f"sandbox overhead: {t_box / t_plain:.2f}x the plain runs' time (goal <= 2x)")


if __name__ == "__main__":
    main()
