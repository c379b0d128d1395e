"""The built-in generation engine against transformers (fp32, tiny random models).

Proves: greedy output equals ``generate(do_sample=False)`` (three families,
mixed prompt lengths, requests joining mid-run); returned logprobs equal a full
forward's (LOGPROB_ATOL); seeded sampling is reproducible and respects
top-k / top-p; stop tokens / strings; n samples; interruption (abort and
retract) + continuation under new weights with per-segment logprobs; weight
updates (disk, HF tensors, megatron tensors, shared megatron parameters) change
outputs and bump the version; bad input raises ValueError naming the field and
leaves the engine working; tp = 2 (2-process gloo, megatron-sharded
parameters) equals tp = 1.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from parallel.testing import make_tiny_hf, run_cases
from realflow.api.generation import SamplingParams

torch.set_num_threads(1)
MODULE = __name__.rsplit(".", 1)[-1]
LOGPROB_ATOL = 1e-4  # |engine logprob - transformers full-forward logprob|, fp32
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
FAMILIES = {
    "qwen2": dict(family="qwen2", tie_word_embeddings=False),
    "llama": dict(family="llama", tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
    "qwen3": dict(family="qwen3", tie_word_embeddings=False, head_dim=24),
}
PROMPTS = [[5], [7, 8, 9], list(range(10, 27)), [3, 141, 59, 26, 53, 58, 97, 93, 23, 84, 62, 64, 33],
           [100, 101], list(range(40, 100))]


def greedy(max_new: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """family -> (path, hf_model); plus 'qwen2_b': the same architecture, other weights."""
    out = {}
    for name, kw in FAMILIES.items():
        path = str(tmp_path_factory.mktemp(name))
        _, model = make_tiny_hf(path, seed=len(name), **kw)
        out[name] = (path, model)
    path = str(tmp_path_factory.mktemp("qwen2_b"))
    _, model = make_tiny_hf(path, seed=99, **FAMILIES["qwen2"])
    out["qwen2_b"] = (path, model)
    return out


def _engine(path, **kw):
    from parallel.generation import EngineConfig, GenerationEngine

    return GenerationEngine.from_hf(path, EngineConfig(**kw))


def hf_greedy(model, prompt, max_new):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_logprobs(model, prompt, output, temperature=1.0):
    logits = model(torch.tensor([prompt + output])).logits[0].float() / temperature
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
    return lp.gather(1, torch.tensor(output)[:, None]).squeeze(1), logits[len(prompt) - 1:-1]


def assert_logprobs(model, res, prompt=None, start=0, end=None):
    prompt = res.prompt_ids if prompt is None else prompt
    ref, _ = hf_logprobs(model, prompt, res.output_ids)
    got = torch.tensor(res.output_logprobs)
    diff = (ref[start:end] - got[start:end]).abs().max().item()
    assert diff <= LOGPROB_ATOL, f"logprob mismatch {diff:.2e} > {LOGPROB_ATOL}"


# --------------------------------------------------------------------------- greedy / logprobs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_transformers_with_joins(ckpts, family):
    path, model = ckpts[family]
    eng = _engine(path, max_running_requests=4)
    max_new = 10
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(f"r{i}", p, greedy(max_new))
    results = []
    for _ in range(3):  # run a few steps, then more requests join the running batch
        results += eng.step()
    for i, p in enumerate(PROMPTS[3:], start=3):  # 6 requests > 4 slots: some wait, slots are reused
        eng.add_request(f"r{i}", p, greedy(max_new + i))
    while eng.has_work():
        results += eng.step()
    by_rid = {r.rid: r for r in results}
    assert len(by_rid) == len(PROMPTS)
    for i, p in enumerate(PROMPTS):
        r = by_rid[f"r{i}"]
        assert r.output_ids == hf_greedy(model, p, len(r.output_ids)), f"prompt {i}"
        assert len(r.output_ids) == (max_new if i < 3 else max_new + i)
        assert r.finish_reason["type"] == "length"
        assert_logprobs(model, r)


def test_eos_stops_and_context_limit(ckpts):
    path, model = ckpts["qwen2"]
    eng = _engine(path, max_model_len=24)
    base = eng.generate([PROMPTS[1]], greedy(8))[0].output_ids
    eng.spec = dataclasses.replace(eng.spec, eos_token_ids=(base[3],))  # as if eos were base[3]
    r = eng.generate([PROMPTS[1]], SamplingParams(max_new_tokens=8, temperature=0.0))[0]
    assert r.output_ids == base[:base.index(base[3]) + 1]
    assert r.finish_reason == {"type": "stop", "matched": base[3]}
    long = eng.generate([PROMPTS[2]], greedy(100))[0]  # 17 + 7 = 24 = max_model_len
    assert len(long.output_ids) == 7 and long.finish_reason["type"] == "length"
    assert long.output_ids == hf_greedy(model, PROMPTS[2], 7)


# --------------------------------------------------------------------------- sampling


def test_sampling_seeded_topk_topp(ckpts):
    path, model = ckpts["qwen2"]
    eng = _engine(path)
    p = PROMPTS[3]
    sp = lambda **kw: SamplingParams(max_new_tokens=16, ignore_eos=True, **kw)  # noqa: E731
    a = eng.generate([p], sp(temperature=1.0, seed=7))[0]
    b = eng.generate([p, PROMPTS[0]], sp(temperature=1.0, seed=7))[0]  # other batch neighbours
    c = eng.generate([p], sp(temperature=1.0, seed=8))[0]
    assert a.output_ids == b.output_ids and a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-6)
    assert a.output_ids != c.output_ids
    assert_logprobs(model, a)
    # top_k = 1 is greedy whatever the temperature
    k1 = eng.generate([p], sp(temperature=1.5, top_k=1, seed=3))[0]
    assert k1.output_ids == hf_greedy(model, p, 16)
    # top_k = 3: every token among the 3 most likely (recomputed); top_p: inside the nucleus
    for kw in (dict(top_k=3), dict(top_p=0.3), dict(top_k=5, top_p=0.5)):
        r = eng.generate([p], sp(temperature=2.0, seed=11, **kw))[0]
        _, logits = hf_logprobs(model, p, r.output_ids, temperature=2.0)
        probs = torch.softmax(logits, -1)
        srt, order = probs.sort(-1, descending=True)
        for j, tok in enumerate(r.output_ids):
            rank = (order[j] == tok).nonzero().item()
            if "top_k" in kw:
                assert rank < kw["top_k"], (kw, j, rank)
            if "top_p" in kw:
                keep = srt[j][: kw.get("top_k", srt.shape[1])]
                keep = keep / keep.sum()
                assert (keep.cumsum(0) - keep)[rank] < kw["top_p"] + 1e-6, (kw, j, rank)
    # logprob_mode="sampling": the distribution actually sampled from (temperature applied)
    s = eng.generate([p], sp(temperature=0.7, seed=5, logprob_mode="sampling"))[0]
    ref, _ = hf_logprobs(model, p, s.output_ids, temperature=0.7)
    assert (ref - torch.tensor(s.output_logprobs)).abs().max() <= LOGPROB_ATOL


def test_mixed_batch_rows_equal_alone(ckpts):
    """Greedy and sampled rows (different warpers and logprob modes) share a batch; each
    row's tokens and logprobs equal its run alone (per-slot settings follow their rows
    when finished rows leave and the batch is compacted)."""
    path, _ = ckpts["qwen2"]
    eng = _engine(path)
    mk = lambda n, **kw: SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)  # noqa: E731
    params = [mk(6, temperature=0.0), mk(14, temperature=1.3, top_k=4, seed=2),
              mk(9, temperature=0.8, top_p=0.6, seed=3, logprob_mode="sampling"),
              mk(12, temperature=1.0, seed=4), mk(5, temperature=0.0, logprob_mode="sampling")]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    together = eng.generate(prompts, params)
    for p, sp, r in zip(prompts, params, together):
        alone = eng.generate([p], sp)[0]
        assert r.output_ids == alone.output_ids and len(r.output_ids) == sp.max_new_tokens
        assert r.output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)
    assert together[4].output_logprobs == [0.0] * 5  # greedy row, "sampling" mode: a point mass


def test_rows_joining_and_leaving_every_step_equal_alone(ckpts):
    """Every row samples, rows leave at different steps and new ones join while others run
    (the per-step row flags are then derived from the cached ones, not rebuilt: a later
    wave brings top-k and another temperature to a batch that had neither); each row's
    tokens and logprobs still equal its run alone."""
    path, _ = ckpts["qwen2"]
    eng = _engine(path, max_prefill_tokens=24)
    waves = [[SamplingParams(max_new_tokens=3 + 2 * i, temperature=1.0, seed=10 * i, ignore_eos=True, n=1 + (i == 0))
              for i in range(4)],  # n = 2, 1, 1, 1: the samples' slots filled by index, not by repeat
             [SamplingParams(max_new_tokens=4 + i, temperature=0.7, top_k=5, seed=20 + i, ignore_eos=True)
              for i in range(3)],
             [SamplingParams(max_new_tokens=6, temperature=1.0, seed=30, n=3, ignore_eos=True)]]
    prompts, results, wanted = {}, {}, {}
    for w, wave in enumerate(waves):
        for i, sp in enumerate(wave):
            rid = f"w{w}-{i}"
            prompts[rid] = PROMPTS[(w + i) % len(PROMPTS)]
            for r in eng.add_request(rid, prompts[rid], sp):
                wanted[r] = (rid, sp)
        for r in eng.step() + eng.step():  # the next wave joins while this one runs
            results[r.rid] = r
    while eng.has_work():
        results.update((r.rid, r) for r in eng.step())
    assert set(results) == set(wanted)
    for r, (rid, sp) in wanted.items():
        index = int(r.rsplit("-", 1)[1]) if sp.n > 1 else 0
        alone = eng.generate([prompts[rid]], dataclasses.replace(sp, n=1, seed=sp.seed + index))[0]
        assert results[r].output_ids == alone.output_ids, r
        assert results[r].output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)


def test_n_samples_and_seeds(ckpts):
    path, _ = ckpts["qwen2"]
    eng = _engine(path)
    p = PROMPTS[2]
    many = eng.generate([p], SamplingParams(max_new_tokens=10, n=4, seed=20, ignore_eos=True))
    assert [r.rid.rsplit("-", 1)[1] for r in many] == ["0", "1", "2", "3"]
    assert [r.index for r in many] == [0, 1, 2, 3]
    for i, r in enumerate(many):
        single = eng.generate([p], SamplingParams(max_new_tokens=10, seed=20 + i, ignore_eos=True))[0]
        assert single.output_ids == r.output_ids
    assert len({tuple(r.output_ids) for r in many}) > 1


def test_stop_token_ids_and_strings(ckpts, tmp_path):
    from transformers import PreTrainedTokenizerFast

    from experiments.tasks.tokenizer import build_tokenizer

    texts = ["12 + 34 = 46", "the quick brown fox", "hello world"] * 20
    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(texts, vocab_size=120))
    path = str(tmp_path / "m")
    make_tiny_hf(path, vocab_size=len(tok))
    from parallel.generation import GenerationEngine

    eng = GenerationEngine.from_hf(path, tokenizer=tok)
    p = tok.encode("hello")
    base = eng.generate([p], greedy(16))[0].output_ids
    stop_tok = base[5]
    r = eng.generate([p], greedy(16, stop_token_ids=[stop_tok]))[0]
    assert r.output_ids == base[:base.index(stop_tok) + 1]
    assert r.finish_reason == {"type": "stop", "matched": stop_tok}
    text = tok.decode(base)
    target = tok.decode(base[:8])[-2:]  # a string that first completes at or before token 8
    assert target, "degenerate tokenizer output"
    r = eng.generate([p], greedy(16, stop=[target, "\u2603never"]))[0]
    cut = next(k for k in range(1, 17) if target in tok.decode(base[:k]))
    assert r.output_ids == base[:cut], (text, target)
    assert r.finish_reason == {"type": "stop", "matched": target}
    no_tok = _engine(path)
    with pytest.raises(ValueError, match="stop"):
        no_tok.add_request("x", p, greedy(4, stop=["a"]))


# --------------------------------------------------------------------------- interruption / weights


def test_retract_continue_under_new_weights(ckpts):
    (pa, ma), (pb, mb) = ckpts["qwen2"], ckpts["qwen2_b"]
    eng = _engine(pa)
    prompts = [PROMPTS[1], PROMPTS[3]]
    for i, p in enumerate(prompts):
        eng.add_request(f"q{i}", p, greedy(14))
    for _ in range(5):
        assert eng.step() == []
    assert eng.pause("retract") == []
    assert eng.update_weights_from_disk(pb) == 1 and eng.weight_version == 1
    results = []
    while eng.has_work():
        results += eng.step()
    for r, p in zip(sorted(results, key=lambda r: r.rid), prompts):
        k = r.output_versions.count(0)
        assert k == 5 and r.output_versions == [0] * 5 + [1] * 9
        assert r.output_ids[:k] == hf_greedy(ma, p, k)  # segment 1 under A
        assert r.output_ids[k:] == hf_greedy(mb, p + r.output_ids[:k], 14 - k)  # segment 2 under B
        assert_logprobs(ma, r, end=k)
        assert_logprobs(mb, r, start=k)


def test_abort_then_resubmit_prefix(ckpts):
    (pa, ma), (_, mb) = ckpts["qwen2"], ckpts["qwen2_b"]
    eng = _engine(pa)
    p = PROMPTS[4]
    eng.add_request("z", p, greedy(20))
    eng.add_request("w", PROMPTS[0], greedy(20))
    for _ in range(4):
        eng.step()
    part = eng.abort("z")
    assert len(part) == 1 and part[0].finish_reason == {"type": "abort"}
    assert len(part[0].output_ids) == 4 and part[0].output_ids == hf_greedy(ma, p, 4)
    assert_logprobs(ma, part[0])
    rest = eng.pause("abort")
    assert [r.rid for r in rest] == ["w"] and not eng.has_work()
    sd = {k: v for k, v in mb.state_dict().items()}
    assert eng.update_weights_from_tensors(sd, fmt="hf", version=7) == 7
    prefix = p + part[0].output_ids
    cont = eng.generate([prefix], greedy(16))[0]
    assert cont.output_ids == hf_greedy(mb, prefix, 16) and set(cont.output_versions) == {7}
    assert_logprobs(mb, cont)


def test_weight_update_errors_leave_engine_intact(ckpts):
    (pa, ma), (pb, mb) = ckpts["qwen2"], ckpts["qwen2_b"]
    eng = _engine(pa)
    before = eng.generate([PROMPTS[2]], greedy(8))[0].output_ids
    sd = dict(mb.state_dict())
    bad = dict(sd)
    bad["model.layers.1.mlp.down_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="down_proj"):
        eng.update_weights_from_tensors(bad)
    part = {"model.layers.0.self_attn.q_proj.weight": sd["model.layers.0.self_attn.q_proj.weight"]}
    with pytest.raises(ValueError, match="k_proj"):  # a fused entry needs all of q, k, v
        eng.update_weights_from_tensors(part)
    with pytest.raises(ValueError):
        eng.update_weights_from_disk(str(os.path.dirname(pa)) + "/nope")
    assert eng.weight_version == 0
    assert eng.generate([PROMPTS[2]], greedy(8))[0].output_ids == before
    # megatron-named partial update: one layer's fc2 from B changes the output
    from parallel.generation.weights import mcore_from_hf_tensors

    local = mcore_from_hf_tensors(eng.spec, eng.hf_config, sd)
    eng.update_weights_from_tensors({"decoder.layers.1.mlp.linear_fc2.weight":
                                     local["decoder.layers.1.mlp.linear_fc2.weight"]}, fmt="megatron")
    assert eng.weight_version == 1
    eng.update_weights_from_tensors(sd)
    assert eng.generate([PROMPTS[2]], greedy(8))[0].output_ids == hf_greedy(mb, PROMPTS[2], 8)
    eng.flush_cache()
    assert eng.generate([PROMPTS[2]], greedy(8))[0].output_ids == hf_greedy(mb, PROMPTS[2], 8)


def test_staged_update_generation_goes_on_then_swaps(ckpts):
    """Staging builds B beside A while A keeps generating (from another thread, as the gen
    server does); the commit swaps B in and retracts: tokens before it are A's, after B's."""
    import threading

    (pa, ma), (pb, mb) = ckpts["qwen2"], ckpts["qwen2_b"]
    eng = _engine(pa)
    with pytest.raises(ValueError, match="nothing is staged"):
        eng.commit_staged_weights()
    p = PROMPTS[3]
    eng.add_request("s", p, greedy(14))
    for _ in range(3):
        eng.step()
    sd = {k: v.clone() for k, v in mb.state_dict().items()}
    bad = dict(sd, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="up_proj"):
        eng.stage_weights_from_tensors(bad, version=3)
    stager = threading.Thread(target=eng.stage_weights_from_tensors, args=(sd, "hf", 3))
    stager.start()
    for _ in range(2):  # the engine keeps stepping on A meanwhile
        eng.step()
    stager.join()
    eng.step()
    for t in sd.values():  # the staged weights own their memory: the update may be freed
        t.zero_()
    with pytest.raises(ValueError, match="version 3 is staged, not 4"):
        eng.commit_staged_weights(4)
    assert eng.weight_version == 0 and eng.commit_staged_weights(3) == 3
    res = []
    while eng.has_work():
        res += eng.step()
    r = res[0]
    assert r.output_versions == [0] * 6 + [3] * 8
    assert r.output_ids[:6] == hf_greedy(ma, p, 6)
    assert r.output_ids[6:] == hf_greedy(mb, p + r.output_ids[:6], 8)
    assert_logprobs(ma, r, end=6)
    assert_logprobs(mb, r, start=6)
    # a partial staged update keeps every other entry of the weights in use
    from parallel.generation.weights import mcore_from_hf_tensors

    la = mcore_from_hf_tensors(eng.spec, eng.hf_config, dict(ma.state_dict()))
    name = "decoder.layers.1.mlp.linear_fc2.weight"
    assert eng.stage_weights_from_tensors({name: la[name]}, fmt="megatron") == 4
    eng.commit_staged_weights()
    for k, v in eng.weights.tensors.items():
        want = la[k] if k == name else mcore_from_hf_tensors(eng.spec, eng.hf_config, dict(mb.state_dict()))[k]
        assert torch.equal(v.cpu(), want), k


@pytest.mark.parametrize("field,value,match", [
    ("temperature", -0.5, "temperature"), ("top_p", 0.0, "top_p"), ("top_p", 1.5, "top_p"),
    ("top_k", 0, "top_k"), ("top_k", -2, "top_k"), ("n", 0, "n="), ("max_new_tokens", -1, "max_new_tokens"),
    ("seed", -3, "seed"), ("logprob_mode", "x", "logprob_mode"), ("stop_token_ids", [10 ** 6], "stop_token_ids"),
])
def test_bad_params(ckpts, field, value, match):
    eng = _engine(ckpts["qwen2"][0], max_model_len=32)
    sp = greedy(4)
    setattr(sp, field, value)
    with pytest.raises(ValueError, match=match):
        eng.add_request("a", [1, 2], sp)
    for bad_ids, m in (([], "empty"), (list(range(32)), "context"), ([1, 160], r"input_ids\[1\]"),
                       ([1, -1], r"input_ids\[1\]"), ("abc", "list")):
        with pytest.raises(ValueError, match=m):
            eng.add_request("b", bad_ids, greedy(4))
    assert not eng.has_work()
    r = eng.generate([[1, 2]], greedy(0))[0]
    assert r.output_ids == [] and r.finish_reason["type"] == "length"
    assert len(eng.generate([[1, 2]], greedy(4))[0].output_ids) == 4


def test_sampling_params_from_dict():
    sp = SamplingParams.from_dict({"temperature": 0, "stop": "x", "skip_special_tokens": True,
                                   "frequency_penalty": 0.0})
    assert sp.stop == ["x"] and sp.greedy
    with pytest.raises(ValueError, match="frequency_penalty"):
        SamplingParams.from_dict({"frequency_penalty": 0.5})
    with pytest.raises(ValueError, match="tempreature"):
        SamplingParams.from_dict({"tempreature": 1.0})


# --------------------------------------------------------------------------- tp = 2 (and shared megatron params)


def test_tp2_equals_tp1_and_shared_params():
    res = run_cases([f"{MODULE}:case_tp"], world_size=2, timeout=300,
                    pythonpath=[os.path.dirname(os.path.abspath(__file__))])
    assert res["case_tp"].ok, res["case_tp"].error
    assert res["case_tp"].data[0] == res["case_tp"].data[1]


def case_tp(ctx):
    """Each rank: megatron tp=2 model -> engine on its shared params == tp=1 engine == transformers."""
    from parallel.engine import MegatronEngine
    from parallel.generation import GenerationEngine
    from parallel.groups import ParallelStrategy, build_model_groups
    from parallel.hf_io import load_hf_checkpoint

    import torch.distributed as dist

    # transformers' save_pretrained writes on global rank 0 only: every rank builds the
    # same seeded models, rank 0's files are the ones loaded.
    own = os.path.join(ctx.tmpdir, f"r{ctx.rank}")
    cfg, ma = make_tiny_hf(own + "a", seed=1, family="qwen2", tie_word_embeddings=False)
    _, mb = make_tiny_hf(own + "b", seed=2, family="qwen2", tie_word_embeddings=False)
    dist.barrier()
    pa, pb = os.path.join(ctx.tmpdir, "r0a"), os.path.join(ctx.tmpdir, "r0b")
    groups = build_model_groups([0, 1], ParallelStrategy(dp=1, tp=2, pp=1))
    meg = MegatronEngine(cfg, groups, pa, optimizer_config=None)
    tp2 = GenerationEngine.from_megatron(meg)
    assert tp2.spec.tp_size == 2
    tp1 = GenerationEngine.from_hf(pa)
    prompts = PROMPTS[:4]
    out2 = tp2.generate(prompts, greedy(10))
    out1 = tp1.generate(prompts, greedy(10))
    for r2, r1, p in zip(out2, out1, prompts):
        assert r2.output_ids == r1.output_ids == hf_greedy(ma, p, 10)
        d = max(abs(a - b) for a, b in zip(r2.output_logprobs, r1.output_logprobs))
        assert d <= LOGPROB_ATOL, d
    samp = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=4, ignore_eos=True)
    s2, s1 = tp2.generate([prompts[1]], samp)[0], tp1.generate([prompts[1]], samp)[0]
    assert s2.output_ids == s1.output_ids
    # in-place update of the SHARED megatron parameters is seen after weights_updated()
    load_hf_checkpoint(meg.module, pb, cfg, meg.arch, groups.tp_rank, 2)
    assert tp2.weights_updated() == 1
    after = tp2.generate([prompts[2]], greedy(10))[0]
    assert after.output_ids == hf_greedy(mb, prompts[2], 10)
    return {"tp2": [r.output_ids for r in out2], "after": after.output_ids}


def test_kv_cache_shrinks_to_the_memory_it_may_take(ckpts, monkeypatch, caplog):
    import parallel.generation.kv_budget as kv_budget
    from parallel.generation.kv_budget import slot_bytes

    path, model = ckpts["qwen2"]
    cfg = model.config
    per_slot = slot_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads,
                          cfg.hidden_size // cfg.num_attention_heads, 64, torch.float32)
    # CPU (contiguous decode): a row costs its contiguous copy and 64 tokens of pool blocks
    per_row = 2 * per_slot
    free = 3 * per_row * 2 + per_slot  # fraction 0.5: 3 rows (and the pool's scratch row)
    monkeypatch.setattr(kv_budget, "free_bytes", lambda device: free)
    with caplog.at_level("WARNING", logger="realflow.generation"):
        eng = _engine(path, max_running_requests=8, max_model_len=64, gpu_memory_utilization=0.5)
    assert eng.config.max_running_requests == 3 and eng.cache.slots == 3
    kv = eng.stats()["kv_cache_bytes"]
    assert 3 * per_row < kv <= free * 0.5  # the budget counts what the cache allocates
    assert "running 3 sequences at a time instead" in caplog.text
    res = eng.generate(PROMPTS[:5], greedy(6))  # 5 requests through 3 rows: all answered, all exact
    assert [r.output_ids for r in res] == [hf_greedy(model, p, 6) for p in PROMPTS[:5]]

    monkeypatch.setattr(kv_budget, "free_bytes", lambda device: per_slot // 2)
    with pytest.raises(ValueError, match=r"one slot needs .* GiB .*lower max_model_len .* raise gpu_memory_util"):
        _engine(path, max_running_requests=8, max_model_len=64)
    # paged decode (the GPU's layout): the pool is sized by the budget, rows stay as asked
    monkeypatch.setattr(kv_budget, "free_bytes", lambda device: free)
    eng = _engine(path, max_running_requests=8, max_model_len=64, gpu_memory_utilization=0.5,
                  decode_attention="paged")
    assert eng.config.max_running_requests == 8 and eng.cache is None
    assert eng.stats()["kv_cache_bytes"] <= free * 0.5
    assert eng.stats()["kv_blocks"] == (free * 0.5 - per_slot / 64) // (per_slot / 4)
    res = eng.generate(PROMPTS[:5], greedy(6))
    assert [r.output_ids for r in res] == [hf_greedy(model, p, 6) for p in PROMPTS[:5]]
    monkeypatch.setattr(kv_budget, "free_bytes", lambda device: per_slot // 2)
    with pytest.raises(ValueError, match=r"one sequence of max_model_len=64 needs 4 blocks .* lower max_model_len"):
        _engine(path, max_running_requests=8, max_model_len=64, decode_attention="paged")
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=rf"^gpu_memory_utilization={bad} must be in \(0, 1\]"):
            _engine(path, gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match=r"^max_model_len=0 must be an integer >= 2"):
        _engine(path, max_model_len=0)
    ctx = cfg.max_position_embeddings
    with pytest.raises(ValueError, match=rf"^max_model_len={ctx + 1} is above the model's context of {ctx} tokens"):
        _engine(path, max_model_len=ctx + 1)
