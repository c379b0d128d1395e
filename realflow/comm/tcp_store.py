"""A torch.distributed TCPStore that listens on one address only.

Why: ``TCPStore(is_master=True)`` listens on every interface, unauthenticated. Binding
the socket ourselves and handing its descriptor to the store (``master_listen_fd``)
keeps a rendezvous on loopback for local runs, or on the cluster address otherwise.
"""
from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

__all__ = ["host_tcp_store"]


def host_tcp_store(address: str, world_size: int, timeout: datetime.timedelta
                   ) -> tuple[dist.TCPStore, socket.socket]:
    """The hosting side of a store on ``address`` and a free port (``sock.getsockname()``).

    Returns at once (no waiting for clients). Keep ``sock`` open for as long as the store
    serves: the store listens on its descriptor.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((address, 0))
        sock.listen(128)
        store = dist.TCPStore(address, sock.getsockname()[1], world_size, True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    return store, sock
