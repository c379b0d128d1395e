"""Measure this machine's device profile: ``realflow calibrate [--out FILE] [--threads N] [--world N] [--quick]``.

Also ``python -m realflow.apps.calibrate``. Times the operators a training / generation
step is made of (GEMMs, attention, memcpy, small ops, a decode layer, all-reduce /
all-gather / send-recv between ``--world`` local processes) on the current GPU, or on one
CPU worker process with ``--threads`` threads, and writes the fitted numbers as a JSON
device profile (:mod:`realflow.planner.calibrate` says how each is fitted). The
planner reads it as ``device=<FILE>`` (or the ``local`` cluster); shipped profiles built
from published figures (``h100``, ``h200``, ``a100``) need no calibration.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from realflow.planner.profile import DeviceProfile, LinkProfile


def _human(value: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, "")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _seconds(value: float) -> str:
    return f"{value * 1e6:.3g} us" if value < 1e-3 else f"{value * 1e3:.3g} ms"


def _link(link: Optional[LinkProfile]) -> str:
    return "-" if link is None else f"alpha {_seconds(link.alpha_s)}, {_human(link.bandwidth, 'B/s')}"


def summary(prof: DeviceProfile) -> str:
    """The fitted numbers, one a line, with units."""
    rows = [("device", prof.name), ("source", prof.source),
            ("memory", f"{prof.memory_bytes / 2**30:.1f} GiB"),
            ("matmul", f"{_human(prof.matmul_flops, 'FLOP/s')} + {_seconds(prof.matmul_overhead_s)} per call"),
            ("attention", f"{_human(prof.attention_flops, 'FLOP/s')} fwd+bwd + "
                          f"{_seconds(prof.attention_overhead_s)} per call (fwd; bwd counts 2)"),
            ("memory bandwidth", f"{_human(prof.memory_bandwidth, 'B/s')} (read + written)"),
            ("host bandwidth", _human(prof.host_bandwidth, "B/s")),
            ("small op", _seconds(prof.op_overhead_s)),
            ("decode layer fixed", _seconds(prof.decode_layer_overhead_s)),
            ("all-reduce", _link(prof.intra_node)),
            ("all-gather", _link(prof.intra_node_all_gather)),
            ("send/recv", _link(prof.intra_node_p2p))]
    return "\n".join(f"  {k:<20} {v}" for k, v in rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="realflow calibrate",
                                description="Measure this machine and write a device profile (JSON) for the planner.")
    p.add_argument("--out", default="device_profile.json", help="the profile to write (default: ./device_profile.json)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of one CPU worker process (default: 1)")
    p.add_argument("--world", type=int, default=2,
                   help="local processes the links are measured between (default: 2; on GPUs at most one per GPU)")
    p.add_argument("--backend", default="megatron",
                   help="train backend whose framework costs are measured (default: megatron)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and sizes: about a minute instead of several")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.threads < 1 or args.world < 1:
        p.error("--threads and --world must be >= 1")
    from realflow.planner.calibrate import CalibrationError, calibrate

    t0 = time.perf_counter()
    try:
        prof = calibrate(threads=args.threads, quick=args.quick, world=args.world)
    except CalibrationError as e:
        print(f"error: calibration failed: {e}", file=sys.stderr)
        return 2
    try:  # the train backend's own fixed costs, measured by the backend's plugin
        from realflow.api.backend import engine_cost_meters
        from realflow.plugins import load_plugins

        load_plugins()
        measure = engine_cost_meters.get(args.backend)
        prof = dataclasses.replace(prof, **measure(world=max(args.world, 1), quick=args.quick))
    except Exception as e:  # noqa: BLE001 - the primitive profile is still usable
        print(f"warning: framework overheads not measured ({type(e).__name__}: {e}); the planner will count "
              f"primitive ops instead", file=sys.stderr)
    out = Path(args.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(prof.to_json())
        os.replace(tmp, out)  # a reader never sees half a profile
    except OSError as e:
        print(f"error: cannot write {out}: {e}", file=sys.stderr)
        return 2
    print(summary(prof))
    print(f"wrote {out} ({time.perf_counter() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
