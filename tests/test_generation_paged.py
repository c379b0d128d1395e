"""The generation engine's paged KV pool against transformers (fp32, tiny random models).

Proves, with blocks of several sizes, both decode paths (``contiguous``: the CPU's per-row copy;
``paged``: the gather over block tables the GPU uses) and prefix sharing on and off:
greedy output and log-probs equal transformers'; a group's samples share their prompt (prefilled
once) and diverging samples copy-on-write the shared block, giving what independent requests
give; chunked prefill lets others decode meanwhile; prefix-cache hits (an agent's next turn)
are exact and never survive a weight update; a full pool preempts and resumes exactly; every
block is free once the work is done; bad settings are one-line errors.
"""
from __future__ import annotations

import pytest
import torch

from realflow.api.generation import SamplingParams
# the same tiny checkpoints (qwen2, llama3-rope, qwen3, and qwen2_b: other weights) and helpers
from test_generation_engine import FAMILIES, PROMPTS, _engine, assert_logprobs, ckpts, greedy, hf_greedy  # noqa: F401

torch.set_num_threads(1)


def drain(eng, results=None):
    results = [] if results is None else results
    while eng.has_work():
        results += eng.step()
    return results


def all_free(eng):
    eng.pager.alloc.check()
    assert eng.pager.alloc.used_blocks == 0, "KV blocks leaked"


LAYOUTS = [(bs, path, share) for bs in (1, 4, 16) for path in ("contiguous", "paged") for share in (True, False)]


@pytest.mark.parametrize("block_size,decode,sharing", LAYOUTS, ids=lambda v: str(v))
def test_greedy_equals_transformers(ckpts, block_size, decode, sharing):
    """Requests joining mid-run, a greedy group of 3 sharing its prompt, rows finishing at different steps."""
    path, model = ckpts["qwen2"]
    eng = _engine(path, max_running_requests=5, block_size=block_size, decode_attention=decode,
                  prefix_sharing=sharing)
    eng.add_request("g", PROMPTS[2], greedy(9, n=3))
    eng.add_request("a", PROMPTS[1], greedy(7))
    results = [r for _ in range(3) for r in eng.step()]
    for i, p in enumerate(PROMPTS[3:], start=3):
        eng.add_request(f"r{i}", p, greedy(4 + i))
    by_rid = {r.rid: r for r in drain(eng, results)}
    assert len(by_rid) == 3 + 1 + 3
    for rid, p in [("g-0", PROMPTS[2]), ("g-1", PROMPTS[2]), ("g-2", PROMPTS[2]), ("a", PROMPTS[1]),
                   ("r3", PROMPTS[3]), ("r4", PROMPTS[4]), ("r5", PROMPTS[5])]:
        r = by_rid[rid]
        assert r.output_ids == hf_greedy(model, p, len(r.output_ids)), rid
        assert_logprobs(model, r)
    shared = eng.stats()["prefix_shared_tokens"]
    assert shared == (2 * len(PROMPTS[2]) if sharing else 0)
    all_free(eng)


@pytest.mark.parametrize("decode", ["contiguous", "paged", "gather"])
def test_context_that_ends_inside_a_block(ckpts, decode):
    """max_model_len 40 with 16-token blocks: the last block runs past the context. Rows decode to
    the context's end, and a prompt cached in whole blocks is extended into its partial last
    block; the outputs equal transformers' (this gather path failed on a shape error before)."""
    path, model = ckpts["qwen2"]
    eng = _engine(path, max_model_len=40, block_size=16, decode_attention=decode)
    prompt = list(range(10, 27))  # 17 tokens: one whole block, then one token in the next
    first = eng.generate([prompt], greedy(100))[0]
    assert first.finish_reason == {"type": "length", "length": 40 - len(prompt)}
    assert first.output_ids == hf_greedy(model, prompt, len(first.output_ids))
    again = eng.generate([prompt + [5]], greedy(100))[0]  # its first block from the prefix cache
    assert eng.stats()["prefix_cache_hits"] >= 1
    assert again.output_ids == hf_greedy(model, prompt + [5], len(again.output_ids))
    all_free(eng)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_paged_chunked_and_shared(ckpts, family):
    """Each model family on the gather path with small blocks, chunked prefill and a shared group."""
    path, model = ckpts[family]
    eng = _engine(path, block_size=4, max_prefill_tokens=5, decode_attention="paged")
    res = eng.generate([PROMPTS[3], PROMPTS[2], PROMPTS[5]], [greedy(8, n=2), greedy(10), greedy(6)])
    for r in res:
        assert r.output_ids == hf_greedy(model, r.prompt_ids, len(r.output_ids)), r.rid
        assert_logprobs(model, r)
    assert eng.stats()["prefix_shared_tokens"] == len(PROMPTS[3])
    all_free(eng)


@pytest.mark.parametrize("decode", ["contiguous", "paged"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_group_samples_equal_independent_requests(ckpts, family, decode):
    """Copy-on-write: samples of a one-token prompt diverge at token 1 of their first (shared)
    block; a 17-token prompt shares a full block and a partial one. Each sample equals the same
    seed run alone, with sharing and without."""
    path, _ = ckpts[family]
    for prompt in ([5], PROMPTS[2]):
        outs = {}
        for sharing in (True, False):
            eng = _engine(path, block_size=16, decode_attention=decode, prefix_sharing=sharing)
            many = eng.generate([prompt], SamplingParams(max_new_tokens=12, n=4, seed=7, ignore_eos=True))
            alone = [eng.generate([prompt], SamplingParams(max_new_tokens=12, seed=7 + i, ignore_eos=True))[0]
                     for i in range(4)]
            assert [r.output_ids for r in many] == [r.output_ids for r in alone]
            assert all(abs(a - b) < 1e-5 for r, s in zip(many, alone)
                       for a, b in zip(r.output_logprobs, s.output_logprobs))
            assert len({tuple(r.output_ids) for r in many}) > 1  # they did diverge
            outs[sharing] = [r.output_ids for r in many]
            all_free(eng)
        assert outs[True] == outs[False]


def test_group_prefills_its_prompt_once(ckpts):
    path, _ = ckpts["qwen2"]
    prompt = list(range(20, 60))  # 40 tokens
    counts = {}
    for sharing in (True, False):
        eng = _engine(path, prefix_sharing=sharing)
        eng.generate([prompt, prompt[::-1]], SamplingParams(max_new_tokens=5, n=8, seed=1, ignore_eos=True))
        counts[sharing] = eng.stats()["prefill_tokens"]
    assert counts == {True: 80, False: 640}


@pytest.mark.parametrize("decode", ["contiguous", "paged"])
def test_chunked_prefill_keeps_others_decoding(ckpts, decode):
    path, model = ckpts["qwen2"]
    eng = _engine(path, max_prefill_tokens=7, block_size=4, decode_attention=decode)
    eng.add_request("short", PROMPTS[1], greedy(20))
    eng.step()
    eng.add_request("long", PROMPTS[5], greedy(6, n=2))  # 60 tokens: 9 chunks of at most 7, then shared
    steps_waiting, done = 0, []
    while eng.num_waiting:
        done += eng.step()
        steps_waiting += 1
    assert steps_waiting == 9  # one chunk per step ...
    assert eng.stats()["tokens_generated"] == 1 + 9 + 2  # ... while "short" decoded a token in each
    assert eng.stats()["prefill_tokens"] == 3 + 60  # the group's second sample prefilled nothing
    by_rid = {r.rid: r for r in drain(eng, done)}
    for rid, p in (("short", PROMPTS[1]), ("long-0", PROMPTS[5]), ("long-1", PROMPTS[5])):
        assert by_rid[rid].output_ids == hf_greedy(model, p, len(by_rid[rid].output_ids))
        assert_logprobs(model, by_rid[rid])
    all_free(eng)


def test_prefix_cache_serves_the_next_turn_and_never_stale_weights(ckpts):
    (pa, ma), (pb, mb) = ckpts["qwen2"], ckpts["qwen2_b"]
    eng = _engine(pa, block_size=4)
    turn1 = eng.generate([PROMPTS[3]], greedy(10))[0]
    history = PROMPTS[3] + turn1.output_ids + [9, 9]  # 25 tokens: the earlier turn is 23, 5 full blocks
    turn2 = eng.generate([history], greedy(8))[0]
    assert eng.stats()["prefix_cache_hits"] == 5 and eng.stats()["prefill_tokens"] == 13 + 5
    assert turn2.output_ids == hf_greedy(ma, history, 8)
    assert_logprobs(ma, turn2)
    eng.update_weights_from_disk(pb)  # the cache is dropped: the same prompt recomputes under B
    hits = eng.stats()["prefix_cache_hits"]
    again = eng.generate([history], greedy(8))[0]
    assert eng.stats()["prefix_cache_hits"] == hits
    assert again.output_ids == hf_greedy(mb, history, 8)
    assert_logprobs(mb, again)
    all_free(eng)


def test_next_turns_reuse_the_blocks_a_batch_filled_together(ckpts):
    """Contiguous decode copies the blocks its rows fill into the pool, one indexed copy for all
    the rows that fill one on the same step: rows of equal length (and one of another length)
    decode together, then each row's next turn finds its blocks and equals transformers."""
    pa, ma = ckpts["qwen2"]
    eng = _engine(pa, block_size=4, decode_attention="contiguous")
    prompts = [PROMPTS[3], [t + 1 for t in PROMPTS[3]], [t + 2 for t in PROMPTS[3]], PROMPTS[2]]  # 13, 13, 13, 17
    turn1 = eng.generate(prompts, greedy(11))
    hits = eng.stats()["prefix_cache_hits"]
    for p, r in zip(prompts, turn1):
        history = p + r.output_ids + [9]
        turn2 = eng.generate([history], greedy(4))[0]
        # every full block of the earlier turn, decoded ones too (its last token was never fed)
        assert eng.stats()["prefix_cache_hits"] - hits == (len(p) + len(r.output_ids) - 1) // 4
        hits = eng.stats()["prefix_cache_hits"]
        assert turn2.output_ids == hf_greedy(ma, history, 4)
        assert_logprobs(ma, turn2)
    all_free(eng)


@pytest.mark.parametrize("decode", ["contiguous", "paged"])
def test_retract_and_weight_update_mid_run(ckpts, decode):
    (pa, ma), (pb, mb) = ckpts["qwen2"], ckpts["qwen2_b"]
    eng = _engine(pa, block_size=4, decode_attention=decode)
    eng.add_request("g", PROMPTS[3], greedy(14, n=2))
    eng.add_request("x", PROMPTS[1], greedy(14))
    for _ in range(5):
        assert eng.step() == []
    assert eng.pause("retract") == []
    assert eng.pager.alloc.used_blocks == 0  # retracted sequences hold no blocks
    eng.update_weights_from_disk(pb)
    results = sorted(drain(eng), key=lambda r: r.rid)
    for r, p in zip(results, [PROMPTS[3], PROMPTS[3], PROMPTS[1]]):
        assert r.output_versions == [0] * 5 + [1] * 9
        assert r.output_ids[:5] == hf_greedy(ma, p, 5)
        assert r.output_ids[5:] == hf_greedy(mb, p + r.output_ids[:5], 9)
        assert_logprobs(ma, r, end=5)
        assert_logprobs(mb, r, start=5)
    all_free(eng)


@pytest.mark.parametrize("decode", ["contiguous", "paged"])
def test_full_pool_preempts_and_resumes_exactly(ckpts, decode):
    path, model = ckpts["qwen2"]
    # 10 blocks of 4 tokens: 40 tokens for 4 sequences that grow to 16-26 tokens each
    eng = _engine(path, block_size=4, kv_blocks=10, max_model_len=32, decode_attention=decode)
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[4], [11, 12, 13, 14, 15, 16]]
    for i, p in enumerate(prompts):
        eng.add_request(f"p{i}", p, greedy(12))
    peak = 0
    results = []
    while eng.has_work():
        results += eng.step()
        peak = max(peak, eng.pager.alloc.used_blocks)
    assert peak <= 10 and eng.stats()["preempted_requests"] > 0
    for r in results:
        p = prompts[int(r.rid[1:])]
        assert r.output_ids == hf_greedy(model, p, 12)
        assert_logprobs(model, r)
    all_free(eng)


def test_a_chunked_prompt_yields_its_blocks_to_running_rows(ckpts):
    """A pool too small for everything: the half-prefilled prompt is sent back first, then the
    newest rows; every sequence still ends exact."""
    path, model = ckpts["qwen2"]
    eng = _engine(path, block_size=4, kv_blocks=16, max_model_len=64, max_prefill_tokens=8)
    eng.add_request("a", PROMPTS[1], greedy(30))
    eng.add_request("b", [3, 4, 5], greedy(30))
    eng.step()
    eng.add_request("long", list(range(40, 80)), greedy(4))
    results, peak = [], 0
    while eng.has_work():
        results += eng.step()
        peak = max(peak, eng.pager.alloc.used_blocks)
    assert peak <= 16 and eng.stats()["preempted_requests"] > 0
    prompts = {"a": PROMPTS[1], "b": [3, 4, 5], "long": list(range(40, 80))}
    for r in results:
        assert r.output_ids == hf_greedy(model, prompts[r.rid], len(r.output_ids)), r.rid
        assert_logprobs(model, r)
    all_free(eng)


def test_abort_frees_blocks_of_running_waiting_and_chunked(ckpts):
    path, _ = ckpts["qwen2"]
    eng = _engine(path, block_size=4, max_prefill_tokens=16)
    eng.add_request("a", PROMPTS[3], greedy(20, n=3))
    eng.step()
    eng.add_request("long", PROMPTS[5], greedy(5))
    eng.add_request("queued", PROMPTS[1], greedy(5))
    eng.step()
    assert eng.num_waiting == 2 and eng.pager.alloc.used_blocks > 0  # "long" half prefilled
    part = eng.abort("long")
    assert [r.finish_reason for r in part] == [{"type": "abort"}]
    out = eng.pause("abort")
    assert sorted(r.rid for r in out) == ["a-0", "a-1", "a-2", "queued"]
    all_free(eng)


@pytest.mark.parametrize("kw,match", [
    (dict(block_size=3), r"^block_size=3: must be a power of two"),
    (dict(block_size=0), r"^block_size=0: must be a power of two"),
    (dict(block_size=True), r"^block_size=True: must be a power of two"),
    (dict(decode_attention="flash"), r"^decode_attention='flash': expected one of"),
    (dict(kv_blocks=0), r"^kv_blocks=0: must be >= 1"),
    (dict(kv_blocks=3, max_model_len=64, decode_attention="paged"),
     r"^kv_blocks=3: one sequence of max_model_len=64 needs 4 blocks of 16 tokens"),
])
def test_bad_settings_are_one_line(ckpts, kw, match):
    path, _ = ckpts["qwen2"]
    with pytest.raises(ValueError, match=match):
        _engine(path, **kw)


def test_cuda_graph_static_buffers_run_eagerly_on_cpu(ckpts):
    """The code CUDA graphs replay (rows padded to a bucket, context padded to a block bucket,
    padding writing the scratch row), run eagerly: the same tokens and log-probs as the eager
    paged step, through joins, finishes, a shared group and a weight update."""
    from parallel.generation.cuda_graphs import DecodeGraphs, bucket

    assert [bucket(n, 8) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 8]
    (pa, ma), (pb, mb) = ckpts["qwen2"], ckpts["qwen2_b"]
    eng = _engine(pa, max_running_requests=6, block_size=4, decode_attention="paged")
    assert eng.graphs is None  # no CUDA here
    eng.graphs = DecodeGraphs(eng.decoder, eng.pool, 6, eng._tables.shape[1], capture=True)
    assert not eng.graphs.capture  # capture needs CUDA: the static buffers run eagerly
    eng.add_request("g", PROMPTS[3], SamplingParams(max_new_tokens=10, n=3, seed=4, ignore_eos=True))
    eng.add_request("a", PROMPTS[1], greedy(6))
    results = [r for _ in range(4) for r in eng.step()]
    eng.add_request("b", PROMPTS[5], greedy(9))
    results = drain(eng, results)
    ref = _engine(pa, max_running_requests=6, block_size=4, decode_attention="paged")
    ref.add_request("g", PROMPTS[3], SamplingParams(max_new_tokens=10, n=3, seed=4, ignore_eos=True))
    ref.add_request("a", PROMPTS[1], greedy(6))
    expect = [r for _ in range(4) for r in ref.step()]
    ref.add_request("b", PROMPTS[5], greedy(9))
    expect = {r.rid: r for r in drain(ref, expect)}
    for r in results:
        assert r.output_ids == expect[r.rid].output_ids
        assert max(abs(x - y) for x, y in zip(r.output_logprobs, expect[r.rid].output_logprobs)) < 1e-5
    assert_logprobs(ma, next(r for r in results if r.rid == "b"))
    eng.update_weights_from_disk(pb)
    after = eng.generate([PROMPTS[4]], greedy(8))[0]
    assert after.output_ids == hf_greedy(mb, PROMPTS[4], 8)
    all_free(eng)
