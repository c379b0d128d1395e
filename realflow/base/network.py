"""Ports and host addresses.

By default everything binds and advertises 127.0.0.1: a single-host job must not
open ports to the network. A cluster job (``launcher=slurm|ray``: the launcher sets
REALFLOW_CLUSTER=1 for every process it starts) binds and advertises the address other
hosts can reach: $REALFLOW_HOST_IP if set (for hosts with several interfaces), else the
address of the interface that routes outwards. Reading the environment here, where
every socket gets its address, means no bind site can forget to pass the flag.
"""
from __future__ import annotations

import os
import socket

LOOPBACK = "127.0.0.1"


def find_free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free a moment ago on ``host``.

    Another process can still take it before you bind; prefer binding to port 0
    where the API allows it (ZMQ ``bind_to_random_port``) and use this only where a
    port must be known in advance (torch.distributed, etcd).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def find_free_ports(n: int, host: str = LOOPBACK) -> list[int]:
    """``n`` distinct free ports (all sockets are held until every port is chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def cluster_mode() -> bool:
    """True in a process of a cluster job (REALFLOW_CLUSTER=1, set by the launcher)."""
    return os.environ.get("REALFLOW_CLUSTER", "") not in ("", "0")


def host_address(cluster: bool | None = None) -> str:
    """Address to bind and advertise: loopback unless ``cluster`` (default: :func:`cluster_mode`)."""
    if cluster is None:
        cluster = cluster_mode()
    if not cluster:
        return LOOPBACK
    env = os.environ.get("REALFLOW_HOST_IP")
    if env:
        return env
    # Connecting a UDP socket sends nothing; it only asks the kernel for the route.
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
            if not ip.startswith("127."):
                return ip
    except OSError:
        pass
    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        ip = LOOPBACK
    if ip.startswith("127."):
        raise RuntimeError(
            "a cluster job (REALFLOW_CLUSTER=1) but this host has no routable address; set REALFLOW_HOST_IP"
        )
    return ip


def tcp_address(host: str, port: int) -> str:
    """ZMQ-style endpoint 'tcp://host:port'."""
    return f"tcp://{host}:{int(port)}"


def interface_of(address: str) -> str | None:
    """Name of the network interface that holds ``address`` (None if none does).

    Gloo picks the address its sockets use from ``GLOO_SOCKET_IFNAME`` (an interface name)
    or else from what the host name resolves to, which on many hosts is 127.0.0.1 or the
    wrong network; a cluster job names the interface of the address it advertises.
    """
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None
