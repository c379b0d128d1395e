"""realflow.base.devices on a host without CUDA (the GPU side: tests/test_parallel_cuda.py)."""
from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from realflow.base import devices


def test_cpu_host_choices():
    if torch.cuda.is_available():
        pytest.skip("a CUDA host: see tests/test_parallel_cuda.py")
    assert devices.distributed_backend() == "gloo"
    assert devices.select_device(3) == torch.device("cpu") == devices.worker_device()
    assert devices.resolve_precision("auto") == "fp32"
    assert devices.resolve_precision("bf16") == "bf16"
    with pytest.raises(ValueError, match="precision='fp16'.*auto \\| fp32 \\| bf16"):
        devices.resolve_precision("fp16")


def test_local_index_prefers_the_scheduler(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("SLURM_LOCALID", raising=False)
    assert devices.local_index(5) == 5
    monkeypatch.setenv("SLURM_LOCALID", "2")
    assert devices.local_index(5) == 2
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert devices.local_index(5) == 1


def test_to_device_walks_containers_and_leaves_the_rest():
    Pair = namedtuple("Pair", "a b")
    t = torch.arange(3)
    obj = {"x": [t, (t, 1.5)], "pair": Pair(t, "s"), "n": None}
    out = devices.to_host(obj)
    assert out["x"][0] is t and out["x"][1][0] is t and out["x"][1][1] == 1.5  # already there: no copy
    assert isinstance(out["pair"], Pair) and out["pair"].a is t and out["pair"].b == "s" and out["n"] is None
    assert isinstance(out["x"][1], tuple)
