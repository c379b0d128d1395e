"""Model families x parallel layouts, verified against transformers (issue 18 item 5).

tests/test_parallel_hf.py checks each family only on one rank and
tests/test_parallel_layouts.py checks every layout only for Qwen2; this file
closes the gap: every supported non-Qwen2 family feature in every tp/pp layout.

Models (tiny, random, norms perturbed; parallel.testing.make_tiny_hf):

* ``qwen3``: q/k norm, GQA (4 heads / 2 kv), head_dim 24 != hidden / heads, untied;
* ``qwen3_tied``: the same with tied embeddings;
* ``llama``: GQA (8 heads / 2 kv), llama3 RoPE scaling, tied embeddings;
* ``llama_untied``: the same with untied embeddings (lm_head).

Layouts (dp = 1; the cases run in ONE 4-rank gloo group, a layout with fewer
ranks uses ranks 0..tp*pp-1): d1 = t1p1, t2 = t2p1, p2 = t1p2, t2p2.  One case
per (model, layout), named ``case_<model>_<layout>``, checks:

1. packed varlen fp32 logits (one micro-batch and several uneven ones) equal
   transformers' within LOGIT_ATOL max abs, on the output rank;
2. ``save_hf`` from that layout into a fresh directory, then transformers'
   ``AutoModelForCausalLM.from_pretrained`` of it: no missing / unexpected /
   mismatched keys, the same state-dict keys as the original HF model and
   bit-identical tensors (same dtype, ``torch.equal``); tied models keep
   ``lm_head`` tied to the embedding (and the file holds no ``lm_head.weight``),
   untied ones keep their own.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from parallel.testing import make_tiny_hf, run_cases

MODULE = __name__.rsplit(".", 1)[-1]
WORLD = 4
LOGIT_ATOL = 1e-5  # max abs difference vs transformers, fp32
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
_BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             max_position_embeddings=128)
_QWEN3 = dict(_BASE, family="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=24)
_LLAMA = dict(_BASE, family="llama", num_attention_heads=8, num_key_value_heads=2,
              rope_parameters=LLAMA3_ROPE)
MODELS = {
    "qwen3": dict(_QWEN3, tie_word_embeddings=False),
    "qwen3_tied": dict(_QWEN3, tie_word_embeddings=True),
    "llama": dict(_LLAMA, tie_word_embeddings=True),
    "llama_untied": dict(_LLAMA, tie_word_embeddings=False),
}
LAYOUTS = {"d1": (1, 1), "t2": (2, 1), "p2": (1, 2), "t2p2": (2, 2)}  # name -> (tp, pp)
SEQLENS = [5, 17, 1, 9, 30]  # > original_max_position_embeddings: llama3 scaling matters
BUDGETS = (None, 20)  # one micro-batch, and several (uneven) ones
CASES = ["case_setup"] + [f"case_{m}_{lay}" for m in MODELS for lay in LAYOUTS]


def _ids():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, _BASE["vocab_size"], (sum(SEQLENS),), generator=g)


def _path(ctx, name):
    return os.path.join(ctx.tmpdir, name)


# --------------------------------------------------------------------------- cases


def case_setup(ctx):
    """Rank 0: checkpoints + transformers' reference logits (file); HF models kept in its cache."""
    err = None
    if ctx.rank == 0:
        try:
            _make_references(ctx)
        except Exception as e:  # noqa: BLE001 - raised after the barrier, so no rank hangs
            err = e
    dist.barrier()
    if err is not None:
        raise err


def _make_references(ctx):
    from safetensors.torch import save_file

    from parallel.model_config import hf_arch, rope_inv_freq

    ids, refs = _ids(), {}
    ctx.cache["hf"] = {}
    for i, (name, kw) in enumerate(MODELS.items()):
        cfg, model = make_tiny_hf(_path(ctx, name), seed=10 + i, **kw)
        ctx.cache["hf"][name] = model
        chunks, o = [], 0
        with torch.no_grad():
            for n in SEQLENS:
                chunks.append(model(ids[o:o + n][None]).logits[0].float())
                o += n
        refs[name] = torch.cat(chunks).contiguous()
        arch = hf_arch(cfg)
        if name.startswith("qwen3"):
            assert arch.qk_norm and arch.head_dim != cfg.hidden_size // cfg.num_attention_heads
        else:
            hd = arch.head_dim
            plain = 1.0 / (arch.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
            assert not torch.allclose(rope_inv_freq(arch), plain), "llama3 scaling must matter"
    save_file(refs, os.path.join(ctx.tmpdir, "ref.safetensors"))


def _ref_logits(ctx, name):
    if "ref" not in ctx.cache:
        from safetensors.torch import load_file

        ctx.cache["ref"] = load_file(os.path.join(ctx.tmpdir, "ref.safetensors"))
    return ctx.cache["ref"][name]


def _check_reload(ctx, name, out):
    """transformers loads the saved checkpoint into exactly the original model's tensors."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    orig = ctx.cache["hf"][name]  # the writer is rank 0, which made the models
    got, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(got) is type(orig), (type(got), type(orig))
    bad = {k: v for k, v in info.items() if v and k != "error_msgs"}
    assert not bad and not info.get("error_msgs"), info
    a, b = orig.state_dict(), got.state_dict()
    assert sorted(a) == sorted(b), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        in_file = set(f.keys())
    tied = MODELS[name]["tie_word_embeddings"]
    assert got.config.tie_word_embeddings == tied
    emb, head = got.get_input_embeddings().weight, got.get_output_embeddings().weight
    # transformers' convention: a tied checkpoint stores only the embedding
    assert ("lm_head.weight" in in_file) != tied, f"tied={tied}, lm_head.weight saved: {not tied}"
    assert (emb.data_ptr() == head.data_ptr()) == tied, f"tied={tied}: lm_head tying after reload"


def _run(ctx, name, layout):
    from parallel.engine import MegatronEngine
    from parallel.groups import ParallelStrategy, build_model_groups

    tp, pp = LAYOUTS[layout]
    groups = build_model_groups(list(range(tp * pp)), ParallelStrategy(dp=1, tp=tp, pp=pp))
    if not groups.is_member:
        return None
    eng = MegatronEngine(_path(ctx, name), groups, _path(ctx, name), optimizer_config=None, seed=1)
    # logit problems are raised after the collective save, so a failure cannot hang peers
    ids, res, problems = _ids(), {}, []
    for budget in BUDGETS:
        out = eng.forward(ids, SEQLENS, max_tokens_per_mb=budget)
        if (out is None) != (not eng.is_output_rank):
            problems.append(f"budget={budget}: output on rank {ctx.rank}: {out is not None}")
        elif out is not None:
            ref = _ref_logits(ctx, name)
            if out.dtype != torch.float32 or out.shape != ref.shape:
                problems.append(f"budget={budget}: {out.dtype} {tuple(out.shape)}")
                continue
            err = res[f"max_abs_err_mb{budget}"] = (out - ref).abs().max().item()
            if err > LOGIT_ATOL:
                problems.append(f"budget={budget}: max abs logit error {err}")
    out_dir = _path(ctx, f"saved_{name}_{layout}")
    eng.save_hf(out_dir)  # collective; the writer (tp 0, pp 0) is rank 0
    assert not problems, f"{name} {layout}: {problems}"
    if ctx.rank == 0:
        _check_reload(ctx, name, out_dir)
    return res or None


for _m in MODELS:
    for _lay in LAYOUTS:
        globals()[f"case_{_m}_{_lay}"] = (lambda m, lay: lambda ctx: _run(ctx, m, lay))(_m, _lay)


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def results():
    return run_cases([f"{MODULE}:{c}" for c in CASES], world_size=WORLD, timeout=300,
                     pg_timeout=120, pythonpath=[os.path.dirname(__file__)])


@pytest.mark.timeout(360)
@pytest.mark.parametrize("case", CASES)
def test_families(results, case):
    r = results[case]
    print(f"{case}: {r.seconds:.1f}s {[d for d in r.data.values() if d]}")
    assert r.ok, r.error
