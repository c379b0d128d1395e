"""Cluster descriptions: how many devices, which profile, and the links between them.

Written as a JSON file::

    {"nodes": 2, "devices_per_node": 8, "device": "h100",
     "inter_node": {"alpha_s": 1e-5, "bandwidth": 4.0e10}}

or as a short name: ``16xh100`` (nodes of 8, InfiniBand NDR between them), ``1024xa100``,
``local`` (this machine: one node, one device per worker, the profile from ``realflow
calibrate``). Everything is checked, and an error names the field that is missing or wrong.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Sequence

from realflow.planner.profile import DeviceProfile, LinkProfile, ProfileError, load_profile

#: InfiniBand NDR, one 400 Gb/s HCA per GPU: ~50 GB/s raw, ~40 GB/s of all-reduce bus bandwidth
#: across nodes (nccl-tests on DGX H100 SuperPODs); HDR (200 Gb/s) for A100 nodes.
DEFAULT_INTER_NODE = {"h100": LinkProfile(1e-5, 4.0e10), "h200": LinkProfile(1e-5, 4.0e10),
                      "a100": LinkProfile(1e-5, 2.0e10)}
GPUS_PER_NODE = 8
_SHORT = re.compile(r"^(\d+)x([A-Za-z0-9_.-]+)$")


class ClusterError(ValueError):
    """A cluster description that cannot be used; the message says what is missing."""


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int
    devices_per_node: int
    device: DeviceProfile
    inter_node: LinkProfile
    name: str = ""

    @property
    def n_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node

    def link(self, devices: Sequence[int]) -> LinkProfile:
        """The slowest link a collective over ``devices`` crosses."""
        if len({self.node_of(d) for d in devices}) <= 1:
            return self.device.intra_node
        return self.inter_node

    def describe(self) -> str:
        return (f"{self.name or 'cluster'}: {self.nodes} node(s) x {self.devices_per_node} {self.device.name} "
                f"({self.device.memory_bytes / 2**30:.0f} GiB each; {self.device.source})")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ClusterError(msg)


def cluster_from_dict(d: dict[str, Any], where: str = "cluster") -> ClusterSpec:
    known = {"nodes", "devices_per_node", "device", "inter_node", "memory_bytes", "name"}
    unknown = sorted(set(d) - known)
    _check(not unknown, f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
    for key in ("nodes", "devices_per_node", "device"):
        _check(key in d, f"{where}: missing field {key!r} (needs nodes, devices_per_node, device)")
    for key in ("nodes", "devices_per_node"):
        _check(isinstance(d[key], int) and d[key] >= 1, f"{where}: {key}={d[key]!r} must be an integer >= 1")
    try:
        device = load_profile(str(d["device"]))
    except ProfileError as e:
        raise ClusterError(f"{where}: device: {e}") from None
    if "memory_bytes" in d:
        mem = d["memory_bytes"]
        _check(isinstance(mem, (int, float)) and mem > 0, f"{where}: memory_bytes={mem!r} must be > 0")
        device = replace(device, memory_bytes=int(mem))
    inter = d.get("inter_node")
    if inter is None:
        _check(d["nodes"] == 1 or device.name in DEFAULT_INTER_NODE,
               f"{where}: inter_node {{alpha_s, bandwidth}} is needed for {d['nodes']} nodes of {device.name!r} "
               f"(defaults exist for {sorted(DEFAULT_INTER_NODE)})")
        link = DEFAULT_INTER_NODE.get(device.name, device.intra_node)
    else:
        _check(isinstance(inter, dict) and set(inter) == {"alpha_s", "bandwidth"},
               f"{where}: inter_node must be {{\"alpha_s\": s, \"bandwidth\": bytes/s}}, got {inter!r}")
        link = LinkProfile(float(inter["alpha_s"]), float(inter["bandwidth"]))
        try:
            link.validate(f"{where}: inter_node")
        except ProfileError as e:
            raise ClusterError(str(e)) from None
    return ClusterSpec(d["nodes"], d["devices_per_node"], device, link, name=str(d.get("name", "")))


def parse_cluster(text: str, local_devices: Optional[int] = None, local_profile: str = "cpu-example") -> ClusterSpec:
    """A cluster from a JSON file, ``<N>x<profile>`` or ``local`` (``local_devices`` workers)."""
    if text == "local":
        _check(local_devices is not None and local_devices >= 1, "cluster=local needs a worker count")
        return cluster_from_dict({"nodes": 1, "devices_per_node": local_devices, "device": local_profile,
                                  "name": "local"}, where="cluster=local")
    m = _SHORT.match(text)
    if m:
        n, dev = int(m.group(1)), m.group(2)
        _check(n >= 1, f"cluster={text!r}: needs at least one device")
        per_node = min(n, GPUS_PER_NODE)
        _check(n % per_node == 0, f"cluster={text!r}: {n} devices do not fill nodes of {GPUS_PER_NODE}")
        return cluster_from_dict({"nodes": n // per_node, "devices_per_node": per_node, "device": dev, "name": text},
                                 where=f"cluster={text}")
    path = Path(text)
    _check(path.is_file(), f"cluster={text!r}: not a file, 'local' or '<N>x<profile>' (e.g. 16xh100)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ClusterError(f"cluster file {text!r} is not JSON: {e}") from None
    _check(isinstance(data, dict), f"cluster file {text!r} must hold a JSON object")
    return cluster_from_dict(data, where=f"cluster file {text!r}")
