"""The contiguous decode path's per-row KV slots and reused buffers (CPU).

Proves: the slots grow with the longest running row (doubling, the live rows' keys and values
kept exactly) and a new batch starts small again when the last one used under half of them;
generation across several growths equals transformers; a decode step writing its activations into the reused workspace gives bit-identical
logits to one that allocates; a row past ``max_len`` is a clear error.
"""
from __future__ import annotations

import pytest
import torch

from parallel.generation.decoder import KVCache
from test_generation_engine import PROMPTS, _engine, assert_logprobs, ckpts, greedy, hf_greedy  # noqa: F401

torch.set_num_threads(1)


def _cache(eng, slots=4, max_len=100):
    return KVCache(eng.spec, slots, max_len, torch.float32, torch.device("cpu"))


def test_slots_grow_keeping_live_rows_and_shrink_when_idle(ckpts):
    eng = _engine(ckpts["qwen2"][0], max_running_requests=2)
    c = _cache(eng)
    assert c.capacity == KVCache.MIN_CAPACITY
    g = torch.Generator().manual_seed(0)
    k = torch.randn(4, c.groups, 10, c.head_dim, generator=g)
    v = torch.randn(4, c.groups, 10, c.head_dim, generator=g)
    for layer in range(c.layers):
        c.write_prefix(layer, 0, k, v)
    c.reserve(40, live=3)  # 16 -> 64, slots 0..2 kept, slot 3 (not live) may go
    assert c.capacity == 64
    assert torch.equal(c.k[:, :3, :, :10], k[:3].expand(c.layers, *k[:3].shape))
    assert torch.equal(c.v[:, :3, :, :10], v[:3].expand(c.layers, *v[:3].shape))
    assert float(c.k[:, :3, :, 10:].abs().sum()) == 0.0  # the new room is zeros (finite under the mask)
    assert c.max_nbytes == c.nbytes // 64 * 100
    # nbytes is arithmetic (the server's /metrics thread reads it while reserve() swaps tensors)
    assert c.nbytes == c.k.numel() * c.k.element_size() + c.v.numel() * c.v.element_size()
    c.reserve(50, live=3)
    assert c.capacity == 64  # enough room: nothing moves
    c.reserve(5, live=0)  # a new batch: the last one needed 50 positions, so the 64 stay (no regrowth)
    assert c.capacity == 64
    for layer in range(c.layers):  # every layer's prefix write reserves: decided once per batch
        c.reserve(5, live=0)
    assert c.capacity == 64
    c.reserve(9, live=2)  # this batch peaks at 9 ...
    c.reserve(5, live=0)  # ... so the next one gives back what is over twice that
    assert c.capacity == KVCache.MIN_CAPACITY
    assert c.nbytes == c.k.numel() * c.k.element_size() * 2 and c.k_flat[0].data_ptr() == c.k[0].data_ptr()
    c.reserve(100, live=0)
    assert c.capacity == 100  # capped at max_len
    with pytest.raises(ValueError, match="position 100 is past max_len 100"):
        c.reserve(101, live=1)


def test_generation_across_growths_equals_transformers(ckpts):
    """Rows joining and leaving while the slots grow 16 -> 32 -> 64 -> 128 under them."""
    path, model = ckpts["qwen2"]
    eng = _engine(path, max_running_requests=3, decode_attention="contiguous")
    eng.add_request("long", PROMPTS[5], greedy(50))  # 60 prompt tokens + 50
    eng.add_request("short", PROMPTS[1], greedy(5))
    results = []
    for _ in range(3):
        results += eng.step()
    eng.add_request("mid", PROMPTS[3], greedy(30))
    while eng.has_work():
        results += eng.step()
    assert eng.cache.capacity == 128
    by_rid = {r.rid: r for r in results}
    for rid, p in [("long", PROMPTS[5]), ("short", PROMPTS[1]), ("mid", PROMPTS[3])]:
        r = by_rid[rid]
        assert r.output_ids == hf_greedy(model, p, len(r.output_ids)), rid
        assert_logprobs(model, r)
    # a new batch after one that needed 110 positions: the 128 stay (and it still equals transformers);
    # the batch after that one (which needed a few) starts small again
    for rid, expect in (("again", 128), ("and again", KVCache.MIN_CAPACITY)):
        eng.add_request(rid, PROMPTS[1], greedy(4))
        out = []
        while eng.has_work():
            out += eng.step()
        assert eng.cache.capacity == expect, rid
        assert out[0].output_ids == hf_greedy(model, PROMPTS[1], 4)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_workspace_decode_is_bit_identical(ckpts, family):
    eng = _engine(ckpts[family][0], max_running_requests=6)
    dec = eng.decoder
    assert dec.ws is not None  # CPU
    g = torch.Generator().manual_seed(1)
    B, P = 6, 9
    ids = torch.randint(3, 100, (B, P), generator=g)
    lens = torch.full((B,), P)
    outs = []
    for ws in (dec.ws, None):
        dec.ws = ws
        cache = _cache(eng, slots=B, max_len=32)
        dec.prefill(ids, lens, cache, 0)
        toks, pos = torch.randint(3, 100, (B,), generator=torch.Generator().manual_seed(2)), lens.clone()
        step_logits = []
        for _ in range(3):
            logits = dec.decode(toks, pos, cache)
            step_logits.append(logits)
            toks, pos = logits.argmax(-1), pos + 1
        outs.append(torch.stack(step_logits))
    assert torch.equal(outs[0], outs[1])


def _huge_kb(ptr: int) -> int:
    """AnonHugePages (kB) of the mapping holding address ``ptr`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def test_kv_memory_is_zeroed_and_huge_page_backed():
    """The pool and slots' memory (parallel.generation.host_memory): zeros, and on a Linux host whose
    transparent huge pages are on (always / madvise) backed by 2 MB pages."""
    import os

    from parallel.generation.host_memory import kv_zeros

    small = kv_zeros((3, 5), torch.float32, torch.device("cpu"))
    assert small.shape == (3, 5) and float(small.abs().sum()) == 0.0
    mode_file = "/sys/kernel/mm/transparent_hugepage/enabled"
    thp = os.path.exists(mode_file) and "[never]" not in open(mode_file).read()
    fallback0 = _vmstat("thp_fault_fallback")
    t = kv_zeros((4, 1024, 1024), torch.float32, torch.device("cpu"))  # 16 MB
    assert t.shape == (4, 1024, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    assert float(t.abs().sum()) == 0.0
    assert t.data_ptr() % (2 << 20) == 0  # the huge-page path: a 2 MB-aligned range
    if not thp:
        pytest.skip("transparent huge pages are off on this host")
    # backed by huge pages, or the kernel tried and had no free 2 MB page (memory fragmented)
    assert _huge_kb(t.data_ptr()) >= 2048 or _vmstat("thp_fault_fallback") > fallback0, \
        "the KV memory is not backed by huge pages"


def _vmstat(key: str) -> int:
    with open("/proc/vmstat") as f:
        for line in f:
            name, value = line.split()
            if name == key:
                return int(value)
    return 0
