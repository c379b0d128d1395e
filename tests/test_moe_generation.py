"""Qwen3-MoE in the built-in generation engine, and the routed experts it returns (R3), end to end.

Proves, on a tiny random Qwen3-MoE (8 experts, top-2, fp32):
* greedy output equals transformers' ``generate(do_sample=False)`` (tp = 1 from the HF checkpoint;
  tp = 2 on a megatron engine's shared, tp-split expert parameters);
* ``routed_experts`` has one row per input token (prompt + output - 1) and each row holds the
  experts transformers' router picks for that token (same sets, compared sorted), also after a
  retraction re-prefills a sequence mid-answer; it is absent when not asked and for dense models;
* the gen server answers it (base64 + shape + dtype), the rollout controller's ServerPool decodes
  it into Completed, and it becomes the trajectory batch key ``routed_experts`` [tokens, layers,
  topk], aligned with ``packed_input_ids``, which survives the data plane's codec;
* SGLang's format (flat int32, no shape) decodes to the same array;
* the actor's sync generate MFC emits the key (tp = 2 case).
"""
from __future__ import annotations

import asyncio
import base64
import os

import numpy as np
import pytest
import torch

from parallel.testing import make_tiny_hf, run_cases
from realflow.api.generation import SamplingParams

torch.set_num_threads(1)
MODULE = __name__.rsplit(".", 1)[-1]
PROMPTS = [[5], [7, 8, 9], list(range(10, 27)), [100, 101], list(range(40, 70))]
TOPK = 2


def greedy(max_new: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(path, transformers model) of a tiny random Qwen3-MoE checkpoint."""
    path = str(tmp_path_factory.mktemp("qwen3_moe"))
    _, model = make_tiny_hf(path, family="qwen3_moe", seed=3)
    return path, model


@pytest.fixture(scope="module")
def engine(moe):
    from parallel.generation import EngineConfig, GenerationEngine

    return GenerationEngine.from_hf(moe[0], EngineConfig(max_running_requests=8))


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_routing(model, ids) -> np.ndarray:
    """[len(ids), layers, topk] expert ids transformers' router picks for each token (sorted per row)."""
    logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
    picks = [torch.topk(torch.softmax(lg.float(), -1), TOPK, -1).indices for lg in logits]  # each [T, k]
    return np.sort(torch.stack(picks, 1).numpy(), -1)


def check_routing(model, prompt, output, routed):
    ids = list(prompt) + list(output)
    assert routed.shape == (len(ids) - 1, 2, TOPK) and routed.dtype == np.uint8
    np.testing.assert_array_equal(np.sort(routed, -1), hf_routing(model, ids)[:-1])


# --------------------------------------------------------------------------- engine, tp = 1


def test_greedy_equals_transformers_and_routing_is_the_routers(engine, moe):
    _, model = moe
    results = engine.generate(PROMPTS, greedy(12))
    for p, r in zip(PROMPTS, results):
        assert r.output_ids == hf_greedy(model, p, 12)
        check_routing(model, p, r.output_ids, r.routed_experts)


def test_a_group_sharing_its_prompt_and_a_chunked_prompt_keep_their_routing(moe):
    """The n samples of a request share the prompt their leader prefilled (its routing rows are
    copied), and a prompt prefilled in chunks records each chunk's rows at their positions."""
    from parallel.generation import EngineConfig, GenerationEngine

    _, model = moe
    eng = GenerationEngine.from_hf(moe[0], EngineConfig(max_running_requests=4, block_size=4, max_prefill_tokens=5))
    group = eng.generate([PROMPTS[2]], SamplingParams(max_new_tokens=8, n=3, seed=3, ignore_eos=True))
    assert eng.stats()["prefix_shared_tokens"] == 2 * len(PROMPTS[2])
    for r in group:
        check_routing(model, PROMPTS[2], r.output_ids, r.routed_experts)
    assert len({tuple(r.output_ids) for r in group}) > 1


def test_expert_path_without_cpu_copies_gives_the_same_answers(moe):
    """The GPU path (no transposed CPU copies: ``F.linear`` on the shared expert weights) equals the CPU one."""
    from parallel.generation import EngineConfig, GenerationEngine

    eng = GenerationEngine.from_hf(moe[0], EngineConfig(max_running_requests=4))
    before = eng.generate(PROMPTS[:3], greedy(8))
    for layer in eng.weights.layers:
        layer.moe.fc1_t = layer.moe.fc2_t = None
    after = eng.generate(PROMPTS[:3], greedy(8))
    for a, b in zip(before, after):
        assert a.output_ids == b.output_ids
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < 1e-5


def test_routing_after_a_retraction_covers_the_whole_sequence(engine, moe):
    _, model = moe
    rids = [engine.add_request(f"re{i}", p, greedy(10))[0] for i, p in enumerate(PROMPTS[:3])]
    for _ in range(4):
        assert engine.step() == []
    engine.pause("retract")  # the next step re-prefills prompt + output so far
    done = {}
    while len(done) < len(rids):
        done.update({r.rid: r for r in engine.step()})
    for rid, p in zip(rids, PROMPTS):
        r = done[rid]
        assert r.output_ids == hf_greedy(model, p, 10)
        check_routing(model, p, r.output_ids, r.routed_experts)


def test_weight_updates_reach_experts_and_router(moe, tmp_path):
    """A disk update and an HF-tensor update (the servers' paths) rewrite the experts and the
    router's fp32 copy: outputs and routing follow the new weights."""
    from parallel.generation import EngineConfig, GenerationEngine
    from parallel.hf_io import read_hf_tensors

    eng = GenerationEngine.from_hf(moe[0], EngineConfig(max_running_requests=4))
    other = str(tmp_path / "b")
    _, model_b = make_tiny_hf(other, family="qwen3_moe", seed=11)
    assert eng.update_weights_from_disk(other) == 1
    r = eng.generate([PROMPTS[2]], greedy(8))[0]
    assert r.output_ids == hf_greedy(model_b, PROMPTS[2], 8)
    check_routing(model_b, PROMPTS[2], r.output_ids, r.routed_experts)
    names = [n for g in eng.hf_weight_groups() for n in g]  # HF names: per-expert, and the routers
    hf = read_hf_tensors(moe[0], names)
    assert eng.update_weights_from_tensors(hf, "hf") == 2
    r = eng.generate([PROMPTS[2]], greedy(8))[0]
    assert r.output_ids == hf_greedy(moe[1], PROMPTS[2], 8)
    check_routing(moe[1], PROMPTS[2], r.output_ids, r.routed_experts)


def test_routing_only_when_asked_and_only_for_moe(engine, tmp_path):
    from parallel.generation import GenerationEngine

    off = engine.generate([PROMPTS[1]], greedy(4, return_routed_experts=False))[0]
    assert off.routed_experts is None
    with pytest.raises(ValueError, match="return_routed_experts"):
        SamplingParams(return_routed_experts="yes").validate()
    make_tiny_hf(str(tmp_path), family="qwen2", seed=1)
    dense = GenerationEngine.from_hf(str(tmp_path)).generate([[1, 2]], greedy(3, return_routed_experts=True))[0]
    assert dense.routed_experts is None and len(dense.output_ids) == 3


# --------------------------------------------------------------------------- wire formats


def test_sglang_format_decodes_to_the_same_array(engine):
    from realflow.api.routing import decode_routed_experts, encode_routed_experts

    r = engine.generate([PROMPTS[2]], greedy(5))[0]
    rows = len(r.prompt_ids) + len(r.output_ids) - 1
    ours = decode_routed_experts(encode_routed_experts(r.routed_experts), rows)
    np.testing.assert_array_equal(ours, r.routed_experts)
    sglang = {"routed_experts": base64.b64encode(r.routed_experts.astype(np.int32).tobytes()).decode()}
    got = decode_routed_experts(sglang, rows, topk=TOPK, num_experts=8)
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, r.routed_experts)
    with pytest.raises(ValueError, match="topk"):
        decode_routed_experts(sglang, rows)
    with pytest.raises(ValueError, match="cover"):
        decode_routed_experts(encode_routed_experts(r.routed_experts), rows + 1)


# --------------------------------------------------------------------------- gen server -> trainer batch


def test_gen_server_and_pool_carry_routing_into_the_trajectory_batch(moe, engine, start_gen_server):
    from realflow.api.agent import Completion
    from realflow.api.keys import INPUT_IDS, ROUTED_EXPERTS
    from realflow.api.batch import SequenceBatch
    from realflow.api.rollout import rollout_to_batch
    from realflow.api.routing import decode_routed_experts, moe_routing_of
    from realflow.comm.codec import decode, encode
    from realflow.rollout.gen_client import GenerationClient
    from realflow.rollout.server_pool import ServerPool

    path, model = moe
    url, _ = start_gen_server(path, "--max-running-requests", "4")
    prompt = PROMPTS[2]
    with GenerationClient(url, timeout=30, generate_timeout=60) as c:
        r = c.generate(prompt, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
        meta = r["meta_info"]
        assert meta["routed_experts_shape"] == [len(prompt) + 5, 2, TOPK] and meta["routed_experts_dtype"] == "uint8"
        check_routing(model, prompt, r["output_ids"],
                      decode_routed_experts(meta, len(prompt) + len(r["output_ids"]) - 1))
        assert "routed_experts" not in c.generate(prompt, {"max_new_tokens": 2},
                                                  return_routed_experts=False)["meta_info"]

    async def complete():
        pool = ServerPool([url], None, request_timeout=60)
        pool.moe_routing = moe_routing_of(path)
        assert pool.moe_routing == (8, TOPK)
        await pool.start()
        try:
            return await pool.complete("r0", prompt, {"max_new_tokens": 7, "temperature": 0, "ignore_eos": True})
        finally:
            await pool.close()

    done = asyncio.run(asyncio.wait_for(complete(), 60))
    check_routing(model, prompt, done.output_ids, done.routed_experts)
    comp = Completion(done.prompt_ids, done.output_ids, done.logprobs, done.versions, done.finish_reason,
                      routed_experts=done.routed_experts)
    batch = rollout_to_batch("s0", [comp.trajectory(1.0), comp.trajectory(0.0)], version_admit=0)
    wire = SequenceBatch.from_wire(decode(encode(batch.to_wire())))  # the data plane's codec
    n = len(prompt) + 7
    assert wire.seqlens[ROUTED_EXPERTS] == wire.seqlens[INPUT_IDS] == [[n, n]]
    t = wire.data[ROUTED_EXPERTS]
    assert t.dtype == torch.uint8 and tuple(t.shape) == (2 * n, 2, TOPK)
    np.testing.assert_array_equal(t[: n - 1].numpy(), done.routed_experts)
    np.testing.assert_array_equal(t[n - 1].numpy(), done.routed_experts[-1])  # the never-run last token


# --------------------------------------------------------------------------- tp = 2 on megatron's parameters


def test_tp2_megatron_experts_equal_transformers_and_the_sync_mfc_emits_routing():
    res = run_cases([f"{MODULE}:case_tp2", f"{MODULE}:case_expert_parallel"], world_size=2, timeout=300,
                    pythonpath=[os.path.dirname(os.path.abspath(__file__))])
    assert res["case_tp2"].ok, res["case_tp2"].error
    assert res["case_tp2"].data[0] == res["case_tp2"].data[1]
    assert res["case_expert_parallel"].ok, res["case_expert_parallel"].error


def case_expert_parallel(ctx):
    """An expert-parallel trainer (d2e2: each rank half the experts; d1t2e2: the tp ranks) gives
    its colocated generator every expert (gathered over ep, split over tp): greedy == transformers,
    and after the experts change in place a new weight version reaches the generator."""
    import torch.distributed as dist

    from parallel.engine import MegatronEngine
    from parallel.groups import build_model_groups
    from realflow.api.allocation import parse_strategy

    path = os.path.join(ctx.tmpdir, "r0")
    cfg, model = make_tiny_hf(os.path.join(ctx.tmpdir, f"ep{ctx.rank}"), family="qwen3_moe", seed=3)
    dist.barrier()
    prompts = PROMPTS[:3]
    for layout in ("d2e2", "d1t2e2"):
        s = parse_strategy(layout)
        meg = MegatronEngine(cfg, build_model_groups([0, 1], s), path, optimizer_config=None)
        gen = meg.generator(64, version=0, max_running=8)
        for p, r in zip(prompts, gen.generate(prompts, greedy(6))):
            assert r.output_ids == hf_greedy(model, p, 6), layout
            check_routing(model, p, r.output_ids, r.routed_experts)
        with torch.no_grad():  # the trainer's experts move: zero them on every rank
            for n, prm in meg.module.named_parameters():
                if ".local_experts." in n:
                    prm.zero_()
        gen = meg.generator(64, version=1, max_running=8)
        hidden_zero = [r.output_ids for r in gen.generate(prompts, greedy(6))]
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.experts.gate_up_proj.zero_()
                layer.mlp.experts.down_proj.zero_()
        assert hidden_zero == [hf_greedy(model, p, 6) for p in prompts], layout
        model = make_tiny_hf(os.path.join(ctx.tmpdir, f"ep{ctx.rank}b"), family="qwen3_moe", seed=3)[1]
    return None


class _NoTokenizer:
    """The actor's generate reads only ``eos_token_id`` (the tiny checkpoint has no tokenizer)."""

    eos_token_id = None


def case_tp2(ctx):
    """Each rank: a megatron tp=2 Qwen3-MoE -> engine on its shared params == transformers; the
    ppo_actor's generate MFC on the same engine emits routed_experts aligned with its ids."""
    import torch.distributed as dist

    from mfc.ppo_actor import PPOActorInterface
    from parallel.engine import MegatronEngine
    from parallel.generation import GenerationEngine
    from parallel.groups import ParallelStrategy, build_model_groups
    from realflow.api.batch import MicroBatchSpec, SequenceBatch
    from realflow.api.interface import Model
    from realflow.api.keys import INPUT_IDS, PROMPTS as PROMPTS_KEY, ROUTED_EXPERTS

    own = os.path.join(ctx.tmpdir, f"r{ctx.rank}")
    cfg, model = make_tiny_hf(own, family="qwen3_moe", seed=3)
    dist.barrier()
    groups = build_model_groups([0, 1], ParallelStrategy(dp=1, tp=2, pp=1))
    meg = MegatronEngine(cfg, groups, os.path.join(ctx.tmpdir, "r0"), optimizer_config=None)
    tp2 = GenerationEngine.from_megatron(meg)
    assert tp2.spec.tp_size == 2
    prompts = PROMPTS[:4]
    outs = tp2.generate(prompts, greedy(8))
    for p, r in zip(prompts, outs):
        assert r.output_ids == hf_greedy(model, p, 8)
        check_routing(model, p, r.output_ids, r.routed_experts)
    iface = PPOActorInterface(max_new_tokens=5, temperature=1.0)
    batch = SequenceBatch.from_samples(["a", "b"], {PROMPTS_KEY: [torch.tensor(prompts[1]),
                                                                  torch.tensor(prompts[2])]})
    out = iface.generate(Model("actor", meg, _NoTokenizer(), 0), batch, MicroBatchSpec())
    assert out.seqlens[ROUTED_EXPERTS] == out.seqlens[INPUT_IDS]
    for i in range(2):
        ids = out.sequences(INPUT_IDS, i)[0].tolist()
        routed = out.sequences(ROUTED_EXPERTS, i)[0].numpy()
        np.testing.assert_array_equal(np.sort(routed[:-1], -1), hf_routing(model, ids)[:-1])
    return {"greedy": [r.output_ids for r in outs], "sampled": out.data[INPUT_IDS].tolist()}
