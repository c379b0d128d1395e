"""HF <-> megatron: logits equal transformers (fp32, packed varlen), exact checkpoint
round trip, sharded checkpoints, clear errors on bad checkpoints / configs.

Cases run in one 1-rank gloo group (parallel.testing); pure table functions are
tested in-process.
"""
from __future__ import annotations

import json
import re
import os
import shutil

import pytest
import torch

from parallel.testing import make_tiny_hf, run_cases

MODULE = __name__.rsplit(".", 1)[-1]
LOGIT_ATOL = 1e-5  # max abs difference vs transformers, fp32
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
FAMILIES = {
    "qwen2": dict(family="qwen2", tie_word_embeddings=False),
    "llama": dict(family="llama", tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
    "qwen3": dict(family="qwen3", tie_word_embeddings=False, head_dim=24),
}
CASES = ["case_logits_qwen2", "case_logits_llama", "case_logits_qwen3", "case_roundtrip",
         "case_sharded_checkpoint", "case_bad_shape", "case_missing_tensor",
         "case_unsupported_arch", "case_greedy_generate"]


# --------------------------------------------------------------------------- helpers


def _groups(ctx):
    from parallel.groups import ParallelStrategy, build_model_groups

    if "groups" not in ctx.cache:
        ctx.cache["groups"] = build_model_groups([0], ParallelStrategy(1, 1, 1))
    return ctx.cache["groups"]


def _checkpoint(ctx, name: str):
    """(path, hf_config, hf_model) of a tiny random model, made once per process."""
    key = f"ckpt:{name}"
    if key not in ctx.cache:
        path = os.path.join(ctx.tmpdir, name)
        kw = dict(FAMILIES[name])
        cfg, model = make_tiny_hf(path, seed=len(name), **kw)
        ctx.cache[key] = (path, cfg, model)
    return ctx.cache[key]


def _engine(ctx, name: str, path=None, attention: str = "sdpa"):
    from parallel.engine import MegatronEngine

    ckpt, cfg, _ = _checkpoint(ctx, name)
    return MegatronEngine(cfg, _groups(ctx), path or ckpt, optimizer_config=None, seed=1,
                          attention=attention)


def _hf_packed_logits(model, ids, seqlens):
    out, o = [], 0
    with torch.no_grad():
        for n in seqlens:
            out.append(model(ids[o:o + n][None]).logits[0].float())
            o += n
    return torch.cat(out)


def _check_logits(ctx, name, attention="sdpa"):
    _, cfg, hf = _checkpoint(ctx, name)
    eng = _engine(ctx, name, attention=attention)
    seqlens = [5, 17, 1, 9, 30]
    ids = torch.randint(0, cfg.vocab_size, (sum(seqlens),), generator=torch.Generator().manual_seed(0))
    ref = _hf_packed_logits(hf, ids, seqlens)
    for budget in (None, 20):  # one micro-batch, and several (uneven) ones
        out = eng.forward(ids, seqlens, max_tokens_per_mb=budget)
        assert out.dtype == torch.float32 and out.shape == (sum(seqlens), cfg.vocab_size)
        err = (out - ref).abs().max().item()
        assert err <= LOGIT_ATOL, f"{name} {attention} budget={budget}: max abs logit error {err}"
    return {"max_abs_err": err}


# --------------------------------------------------------------------------- cases


def case_logits_qwen2(ctx):
    # both core attentions: torch SDPA (default) and megatron's own DotProductAttention
    return {a: _check_logits(ctx, "qwen2", attention=a) for a in ("sdpa", "megatron")}


def case_logits_llama(ctx):
    from parallel.model_config import hf_arch, rope_inv_freq

    arch = hf_arch(_checkpoint(ctx, "llama")[1])
    plain = 1.0 / (arch.rope_theta ** (torch.arange(0, arch.head_dim, 2).float() / arch.head_dim))
    assert not torch.allclose(rope_inv_freq(arch), plain), "llama3 scaling must matter here"
    return _check_logits(ctx, "llama")


def case_logits_qwen3(ctx):
    return _check_logits(ctx, "qwen3")


def case_roundtrip(ctx):
    from safetensors.torch import load_file

    tok = os.path.join(ctx.tmpdir, "tok")
    os.makedirs(tok, exist_ok=True)
    for fn in ("tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"):
        with open(os.path.join(tok, fn), "w") as f:
            f.write("{}")
    for name in ("qwen2", "llama"):
        path, cfg, _ = _checkpoint(ctx, name)
        out = os.path.join(ctx.tmpdir, f"{name}_saved")
        _engine(ctx, name).save_hf(out, tokenizer_dir=tok)
        a, b = load_file(os.path.join(path, "model.safetensors")), load_file(
            os.path.join(out, "model.safetensors"))
        assert sorted(a) == sorted(b), set(a) ^ set(b)
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        with open(os.path.join(out, "config.json")) as f:
            saved = json.load(f)
        assert saved["model_type"] == name and saved["tie_word_embeddings"] == cfg.tie_word_embeddings
        assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
        with open(os.path.join(out, "config.json")) as f:
            assert f.read() != "{}", "the tokenizer dir's config.json must not overwrite ours"
        # and the saved checkpoint loads back into an identical engine
        reloaded = _engine(ctx, name, path=out)
        for k, v in reloaded.hf_state_dict().items():
            assert torch.equal(v, a[k]), k


def case_sharded_checkpoint(ctx):
    from safetensors.torch import load_file

    path = os.path.join(ctx.tmpdir, "qwen2_sharded")
    make_tiny_hf(path, seed=len("qwen2"), max_shard_size="40KB", **FAMILIES["qwen2"])
    files = os.listdir(path)
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    single = load_file(os.path.join(_checkpoint(ctx, "qwen2")[0], "model.safetensors"))
    eng = _engine(ctx, "qwen2", path=path)
    state = eng.hf_state_dict()
    assert sorted(state) == sorted(single)
    for k in single:
        assert torch.equal(state[k], single[k]), k


def _broken_copy(ctx, name, edit):
    from safetensors.torch import load_file, save_file

    src = _checkpoint(ctx, name)[0]
    dst = os.path.join(ctx.tmpdir, f"{name}_broken_{edit.__name__}")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def _expect_clean_error(ctx, dst, pattern):
    from parallel.hf_io import CheckpointError, load_hf_checkpoint

    eng = _engine(ctx, "qwen2")
    before = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    with pytest.raises(CheckpointError) as info:
        load_hf_checkpoint(eng.module, dst, eng.hf_config, eng.arch)
    msg = str(info.value)
    assert "\n" not in msg and re.search(pattern, msg), msg
    assert os.path.join(dst, "model.safetensors") in msg or dst in msg, msg
    for n, p in eng.module.named_parameters():  # nothing half-loaded
        assert torch.equal(p, before[n]), n
    return msg


def case_bad_shape(ctx):
    def widen_k(t):  # one more row in a k_proj (e.g. a checkpoint of another config)
        k = "model.layers.1.self_attn.k_proj.weight"
        t[k] = torch.cat([t[k], t[k][:1]])

    msg = _expect_clean_error(ctx, _broken_copy(ctx, "qwen2", widen_k),
                              r"model\.layers\.1\.self_attn\.k_proj\.weight .* shape \[33, 64\]")
    return {"message": msg}


def case_missing_tensor(ctx):
    def drop_norm(t):
        del t["model.layers.0.post_attention_layernorm.weight"]

    msg = _expect_clean_error(ctx, _broken_copy(ctx, "qwen2", drop_norm),
                              r"model\.layers\.0\.post_attention_layernorm\.weight missing")
    return {"message": msg}


def case_unsupported_arch(ctx):
    from transformers import GPT2Config

    from parallel.engine import MegatronEngine

    with pytest.raises(NotImplementedError, match=r"model_type='gpt2'"):
        MegatronEngine(GPT2Config(n_layer=1, n_embd=32, n_head=2), _groups(ctx), None, None)
    _, cfg, _ = _checkpoint(ctx, "qwen2")
    swa = cfg.__class__(**{**cfg.to_dict(), "use_sliding_window": True, "sliding_window": 8})
    with pytest.raises(NotImplementedError, match="use_sliding_window"):
        MegatronEngine(swa, _groups(ctx), None, None)


def case_greedy_generate(ctx):
    _, cfg, hf = _checkpoint(ctx, "qwen2")
    eng = _engine(ctx, "qwen2")
    prompts = [[3, 14, 15, 92, 65], [35, 89], [7, 9, 3]]
    got = eng.greedy_generate(prompts, max_new_tokens=6, eos_token_id=None)
    for p, g in zip(prompts, got):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False,
                              attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              pad_token_id=0)[0, len(p):].tolist()
        assert g == ref, (p, g, ref)
    eos = got[0][2]  # stop early at a token we know comes third
    early = eng.greedy_generate(prompts[:1], max_new_tokens=6, eos_token_id=eos)
    assert early[0] == got[0][: got[0].index(eos) + 1]


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def results():
    return run_cases([f"{MODULE}:{c}" for c in CASES], world_size=1, timeout=150,
                     pythonpath=[os.path.dirname(__file__)])


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", CASES)
def test_hf_megatron(results, case):
    assert results[case].ok, results[case].error


def test_param_table_tp_slicing_roundtrip():
    """The table's per-tp-rank slicing (used by issue 3) inverts exactly and keeps
    megatron's layouts: whole query groups per rank, [gate_r; up_r] for fc1."""
    from transformers import Qwen2Config

    from parallel.hf_io import hf_to_mcore, mcore_to_hf, param_table, tp_shard, tp_unshard
    from parallel.model_config import hf_arch

    cfg = Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=4)
    arch = hf_arch(cfg, tp_size=2)
    by_name = {e.mcore_name: e for e in param_table(cfg, arch)}
    qkv = by_name["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (torch.randn(s) for s in qkv.hf_shapes)
    full = hf_to_mcore(qkv, [q, k, v], arch.padded_vocab_size, 4)
    hd = 4  # 32 / 8
    assert torch.equal(full[: 2 * hd], q[: 2 * hd]) and torch.equal(full[2 * hd: 3 * hd], k[:hd])
    shards = [tp_shard(qkv, full, r, 2) for r in range(2)]
    assert torch.equal(shards[1][2 * hd: 3 * hd], k[2 * hd: 3 * hd])  # rank 1: groups 2, 3
    assert torch.equal(tp_unshard(qkv, shards), full)
    back = mcore_to_hf(qkv, full, 4)
    assert all(torch.equal(a, b) for a, b in zip(back.values(), (q, k, v)))

    fc1 = by_name["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = (torch.randn(s) for s in fc1.hf_shapes)
    full = hf_to_mcore(fc1, [gate, up], arch.padded_vocab_size, 4)
    r1 = tp_shard(fc1, full, 1, 2)
    assert torch.equal(r1, torch.cat([gate[24:], up[24:]]))
    assert torch.equal(tp_unshard(fc1, [tp_shard(fc1, full, r, 2) for r in range(2)]), full)

    emb = by_name["embedding.word_embeddings.weight"]
    assert arch.padded_vocab_size == 256 and emb.mcore_shape == (100, 32)
    e = torch.randn(100, 32)
    padded = hf_to_mcore(emb, [e], arch.padded_vocab_size, 4)
    assert padded.shape == (256, 32) and torch.equal(mcore_to_hf(emb, padded, 4)[emb.hf_names[0]], e)
