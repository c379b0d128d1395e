"""The paged decode attention kernel (Triton) on CPU, through Triton's interpreter.

The kernel is what a GPU decode step runs (``decode_attention="paged"``); here Triton's
interpreter (``TRITON_INTERPRET=1``) runs the very same kernel program by program, so CI checks
its indexing, masking and online softmax. Proves: the kernel equals attention computed from the
gathered context for grouped-query shapes (1-8 query heads per kv head, head dims that are and
are not powers of two, blocks of 16 and 32 tokens, ragged lengths over several tiles, tables wider
than a row needs); an engine decoding through it gives transformers' greedy output and log-probs,
with prefix sharing and copy-on-write, and through the CUDA-graph path's static buffers (run
eagerly here); blocks under 16 tokens fall back to the gather. On a GPU the compiled kernel is
checked by ``benchmarks/device_check.sh``.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from parallel.generation import paged_attention as pa  # noqa: E402
from parallel.testing import paged_attention_reference  # noqa: E402
from test_generation_engine import PROMPTS, _engine, assert_logprobs, ckpts, greedy, hf_greedy  # noqa: E402,F401

torch.set_num_threads(1)
ATOL = 2e-6  # fp32, online vs two-pass softmax


if not pa._interpreting():  # on a GPU host test_parallel_cuda.py checks the compiled kernel
    pytest.skip("TRITON_INTERPRET unset (tests/conftest.py sets it without a GPU)", allow_module_level=True)


@pytest.mark.parametrize("ng,rep,hd,bs", [(2, 2, 32, 16), (1, 4, 24, 32), (4, 1, 64, 16), (1, 8, 16, 16)])
def test_kernel_equals_gathered_attention(ng, rep, hd, bs):
    g = torch.Generator().manual_seed(ng * 100 + rep * 10 + bs)
    blocks, width, B = 40, 12, 5
    k_pool = torch.randn(blocks * bs + 1, ng, hd, generator=g)
    v_pool = torch.randn(blocks * bs + 1, ng, hd, generator=g)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in range(B)])
    lens = torch.tensor([1, bs, bs + 1, 5 * bs - 3, width * bs - 1])  # one token .. several 64-token tiles
    q = torch.randn(B, ng, rep + 1, hd, generator=g)[:, :, :rep]  # a strided view, as decode passes
    got = pa.paged_decode_attention(q, k_pool, v_pool, tables, lens, hd ** -0.5, bs)
    want = paged_attention_reference(q, k_pool, v_pool, tables, lens, hd ** -0.5, bs)
    assert (got - want).abs().max().item() <= ATOL


def test_kernel_for_needs_blocks_of_16():
    assert pa.kernel_for(torch.device("cpu"), 16) is pa.paged_decode_attention  # interpreter on
    assert pa.kernel_for(torch.device("cpu"), 8) is None
    with pytest.raises(ValueError, match="block_size >= 16"):
        pa.paged_decode_attention(torch.zeros(1, 1, 1, 16), torch.zeros(9, 1, 16), torch.zeros(9, 1, 16),
                                  torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 1.0, 8)


@pytest.mark.parametrize("block_size", [16, 32])
def test_engine_through_the_kernel_equals_transformers(ckpts, block_size):
    """Joins mid-run, a greedy group of 3 sharing its prompt (copy-on-write on its first writes),
    rows of several lengths: the paged step attends through the kernel."""
    path, model = ckpts["qwen2"]
    eng = _engine(path, max_running_requests=5, block_size=block_size, decode_attention="paged")
    assert eng.stats()["paged_attention_kernel"] == 1.0
    eng.add_request("g", PROMPTS[2], greedy(9, n=3))
    eng.add_request("a", PROMPTS[1], greedy(20))
    results = [r for _ in range(3) for r in eng.step()]
    eng.add_request("b", PROMPTS[5], greedy(6))  # 60 prompt tokens: a context over several tiles
    while eng.has_work():
        results += eng.step()
    by_rid = {r.rid: r for r in results}
    for rid, p in [("g-0", PROMPTS[2]), ("g-2", PROMPTS[2]), ("a", PROMPTS[1]), ("b", PROMPTS[5])]:
        r = by_rid[rid]
        assert r.output_ids == hf_greedy(model, p, len(r.output_ids)), rid
        assert_logprobs(model, r)
    assert eng.pager.alloc.used_blocks == 0


def test_static_buffer_path_through_the_kernel(ckpts):
    """The CUDA-graph path's padded row / context buckets (run eagerly on CPU) with the kernel."""
    from parallel.generation.cuda_graphs import DecodeGraphs

    path, model = ckpts["qwen3"]
    eng = _engine(path, max_running_requests=3, decode_attention="paged")
    eng.graphs = DecodeGraphs(eng.decoder, eng.pool, 3, eng._tables.shape[1], capture=False)
    res = eng.generate([PROMPTS[3], PROMPTS[0]], greedy(7))
    for p, r in zip([PROMPTS[3], PROMPTS[0]], res):
        assert r.output_ids == hf_greedy(model, p, 7)
        assert_logprobs(model, r)


def test_small_blocks_and_gather_take_the_gather_path(ckpts):
    path, _ = ckpts["qwen2"]
    for kw in (dict(block_size=8, decode_attention="paged"), dict(block_size=16, decode_attention="gather")):
        eng = _engine(path, max_running_requests=2, **kw)
        assert eng.stats()["paged_attention_kernel"] == 0.0
        assert eng.decoder.paged_kernel is None
