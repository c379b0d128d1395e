"""A measured device profile against the shipped one built from published figures.

    python -m benchmarks.compare_profiles measured.json [--against h200]

Prints every scalar field both profiles hold: published, measured and measured/published,
so a shipped profile's assumptions (sustained GEMM and attention rates, launch overheads)
can be checked on a real device.  ``--against`` defaults to the shipped profile whose name
appears in the measured device's name (e.g. "NVIDIA H200" -> h200).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from realflow.planner.profile import DeviceProfile, load_profile, shipped_profiles


def _scalars(p: DeviceProfile) -> dict[str, float]:
    out = {}
    for f in dataclasses.fields(p):
        v = getattr(p, f.name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v:
            out[f.name] = float(v)
        elif dataclasses.is_dataclass(v):  # links: alpha and bandwidth
            for g in dataclasses.fields(v):
                w = getattr(v, g.name)
                if isinstance(w, (int, float)) and w:
                    out[f"{f.name}.{g.name}"] = float(w)
    return out


def _guess(measured: DeviceProfile) -> str:
    name = measured.name.lower()
    for shipped in shipped_profiles():
        if shipped != "cpu-example" and shipped in name:
            return shipped
    raise SystemExit(f"no shipped profile matches device {measured.name!r}; pass --against "
                     f"(one of {shipped_profiles()})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("measured")
    ap.add_argument("--against", default=None, help="shipped profile name or a JSON path")
    a = ap.parse_args(argv)
    measured = load_profile(a.measured)
    published = load_profile(a.against or _guess(measured))
    print(f"measured:  {measured.name}: {measured.source}")
    print(f"published: {published.name}: {published.source[:160]}...")
    m, p = _scalars(measured), _scalars(published)
    print(f"{'field':34s} {'published':>12s} {'measured':>12s} {'ratio':>7s}")
    for key in sorted(set(m) & set(p)):
        print(f"{key:34s} {p[key]:12.4g} {m[key]:12.4g} {m[key] / p[key]:7.2f}")
    only = sorted(set(m) - set(p))
    if only:
        print("measured only: " + ", ".join(f"{k}={m[k]:.4g}" for k in only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
