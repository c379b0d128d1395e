"""During a real run every listening TCP socket of its processes is on 127.0.0.1.

Read from /proc: the run's process tree (children of the launcher), the socket inodes
each holds, and /proc/net/tcp{,6}'s LISTEN entries. This caught torch.distributed's
rendezvous store listening on every interface.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from realflow.base.procfs import proc_stat

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LISTEN = "0A"


def _descendants(root: int) -> set[int]:
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = proc_stat(int(d))
            if st is not None:
                parents[int(d)] = st[1]
    found, grew = {root}, True
    while grew:
        new = {p for p, pp in parents.items() if pp in found and p not in found}
        found |= new
        grew = bool(new)
    return found


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                out.add(target[8:-1])
    except OSError:
        pass
    return out


def _listeners() -> dict[str, str]:
    """inode -> local address (hex, as /proc/net/tcp writes it) of every LISTEN socket."""
    out = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == LISTEN:
                    out[cols[9]] = cols[1].split(":")[0]
    return out


def _is_loopback(hex_addr: str) -> bool:
    if len(hex_addr) == 8:  # IPv4, little-endian: 127.x.x.x ends with 7F
        return hex_addr.endswith("7F")
    return hex_addr == "00000000000000000000000001000000"  # ::1


@pytest.mark.timeout(300)
def test_every_listening_socket_of_a_run_is_loopback(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "realflow.apps.main_sft", f"fileroot={tmp_path}",
                             "max_train_steps=200", "dataset.n_train=2000", "dataset.n_test=16"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: dict[str, str] = {}
    environs: dict[int, bytes] = {}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            listening = _listeners()
            for pid in _descendants(proc.pid):
                for inode in _socket_inodes(pid) & listening.keys():
                    seen[inode] = listening[inode]
                try:
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        environs[pid] = f.read()
                except OSError:
                    pass
            if len(seen) >= 6 and os.path.exists(tmp_path / "sft" / "trial0" / "stats.jsonl"):
                break  # master and workers are up and training
            time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(60)
    assert len(seen) >= 6, f"too few listening sockets seen to judge: {seen}"
    public = {i: a for i, a in seen.items() if not _is_loopback(a)}
    assert not public, f"sockets listening beyond loopback (inode -> hex address): {public}"
    # the experiment secret is in no process's environment: only the path of its 0600 file
    secret_file = tmp_path / "sft" / "trial0" / ".secret"
    assert environs and any(b"REALFLOW_SECRET_FILE=" + str(secret_file).encode() in e for e in environs.values())
    assert not [pid for pid, e in environs.items() if b"REALFLOW_SECRET=" in e]
    assert not secret_file.exists()  # removed when the run stops
