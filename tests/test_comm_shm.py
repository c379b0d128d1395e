"""Shared-memory transfer between real processes: bit-exact (bf16 too), zero copy, and no /dev/shm leaks."""
from __future__ import annotations

import gc
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch

from realflow.comm import shm
from realflow.comm.codec import TORCH_DTYPES

torch.set_num_threads(1)
pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = shm.segment_prefix("pytest", uuid.uuid4().hex[:8])

# Child: "take" prints per-key digests of the tensors in the handle (argv[2]), then waits for a line on stdin;
#        "put" creates tensors, prints the handle and its digests, and exits without anyone taking it.
CHILD = textwrap.dedent("""
    import hashlib, json, sys, torch
    torch.set_num_threads(1)
    from realflow.comm import shm

    def digest(ts):
        return {k: [str(t.dtype), list(t.shape), hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()
                .tobytes() if t.numel() else b"").hexdigest()] for k, t in ts.items()}

    if sys.argv[1] == "take":
        ts = shm.take_tensors(json.loads(sys.argv[2]))
        print(json.dumps(digest(ts)), flush=True)
        sys.stdin.readline()
    else:
        ts = {"x": torch.arange(1000, dtype=torch.int64), "y": torch.randn(64, 3).bfloat16()}
        print(json.dumps({"handle": shm.put_tensors(ts, prefix=sys.argv[2]), "digest": digest(ts)}), flush=True)
""")


def digest(ts: dict[str, torch.Tensor]) -> dict:
    out = {}
    for k, t in ts.items():
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out[k] = [str(t.dtype), list(t.shape), hashlib.sha256(raw).hexdigest()]
    return out


def child(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, *args], env=dict(os.environ, PYTHONPATH=REPO),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ts = {}
    for name, dtype in sorted(TORCH_DTYPES.items()):
        ts[name] = torch.randint(0, 256, (37 * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype)
    ts["bf16_2d_noncontig"] = torch.randn(8, 6, generator=g).bfloat16().t()
    ts["zero_d"] = torch.tensor(2.5, dtype=torch.float64)
    ts["empty"] = torch.empty(0, 4, dtype=torch.float16)
    ts["ids"] = torch.arange(100_000, dtype=torch.int64)
    return ts


@pytest.fixture(autouse=True)
def no_leaks():
    yield
    leaked = shm.cleanup_segments(PREFIX)
    assert leaked == [], f"leaked segments: {leaked}"


def test_cross_process_bit_exact_and_unlinked_on_map():
    ts = sample_tensors()
    handle = shm.put_tensors(ts, prefix=PREFIX)
    assert json.loads(json.dumps(handle)) == handle  # plain data: travels on any control plane
    assert shm.list_segments(PREFIX) == [handle["segment"]]
    proc = child("take", json.dumps(handle))
    try:
        line = proc.stdout.readline()
        assert line, "consumer produced no output"
        assert json.loads(line) == digest(ts)
        assert shm.list_segments(PREFIX) == []  # name gone as soon as it was mapped, consumer still alive
    finally:
        proc.communicate("done\n", timeout=30)
    assert proc.returncode == 0


def test_consumer_killed_after_mapping_leaks_nothing():
    handle = shm.put_tensors({"x": torch.randn(1 << 20)}, prefix=PREFIX)
    proc = child("take", json.dumps(handle))
    try:
        assert proc.stdout.readline()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    assert shm.list_segments(PREFIX) == []


def test_consumer_killed_before_taking_producer_releases():
    handle = shm.put_tensors({"x": torch.randn(1000)}, prefix=PREFIX)
    proc = child("take", "not json: the consumer dies before mapping")
    proc.wait(60)
    assert proc.returncode != 0
    assert shm.list_segments(PREFIX) == [handle["segment"]]
    assert shm.release(handle) is True
    assert shm.release(handle) is False
    assert shm.list_segments(PREFIX) == []


def test_dead_producer_segments_cleaned_up_live_ones_kept():
    proc = child("put", PREFIX)
    out = json.loads(proc.communicate(timeout=60)[0])
    assert proc.returncode == 0
    mine = shm.put_tensors({"y": torch.ones(10)}, prefix=PREFIX)
    assert shm.cleanup_segments(PREFIX, only_dead_producers=True) == [out["handle"]["segment"]]
    assert shm.list_segments(PREFIX) == [mine["segment"]]
    shm.release(mine)
    with pytest.raises(shm.ShmError, match="not found"):
        shm.take_tensors(out["handle"])


def test_take_from_dead_producer_zero_copy_mapping_lifetime():
    proc = child("put", PREFIX)
    out = json.loads(proc.communicate(timeout=60)[0])
    ts = shm.take_tensors(out["handle"])  # the producer already exited: data is still there
    assert digest(ts) == out["digest"]
    assert shm.list_segments(PREFIX) == []
    name = out["handle"]["segment"]

    def mapped() -> bool:
        with open("/proc/self/maps") as f:
            return name in f.read()

    assert mapped()  # zero copy: the tensors live in the (unlinked) segment
    x = ts["x"]
    del ts
    gc.collect()
    assert mapped() and x.sum().item() == sum(range(1000))  # one tensor keeps the whole mapping alive
    del x
    gc.collect()
    assert not mapped()


def test_in_process_round_trip_copy_and_errors():
    ts = sample_tensors()
    out = shm.take_tensors(shm.put_tensors(ts, prefix=PREFIX), copy=True)
    assert digest(out) == digest(ts)
    assert shm.take_tensors(shm.put_tensors({"e": torch.empty(0)}, prefix=PREFIX))["e"].shape == (0,)
    with pytest.raises(shm.ShmError, match="malformed"):
        shm.take_tensors({"segment": "../etc/passwd", "size": 1, "tensors": {}})
    with pytest.raises(shm.ShmError, match="does not fit"):
        shm.take_tensors({"segment": "x", "size": 8, "tensors": {"a": {"dtype": "float32", "shape": [4],
                                                                        "offset": 0, "nbytes": 16}}})
    with pytest.raises(TypeError, match="'bad'"):
        shm.put_tensors({"bad": [1, 2]}, prefix=PREFIX)
    with pytest.raises(ValueError, match="prefix"):
        shm.cleanup_segments("")


def test_pool_reuses_prefaulted_segments_and_cleans_up():
    ts = {"a": torch.randn(1 << 19), "b": torch.arange(1 << 18)}  # 4 MiB
    with shm.ShmPool(PREFIX) as pool:
        pool.reserve(4 << 20)
        for _ in range(3):
            out = shm.take_tensors(pool.put_tensors(ts))
            assert digest(out) == digest(ts)
            assert pool.wait_idle(10)
        assert pool.hits == 3 and pool.misses == 0
        assert len(shm.list_segments(PREFIX)) == 1  # one warm segment waiting
    assert shm.list_segments(PREFIX) == []
