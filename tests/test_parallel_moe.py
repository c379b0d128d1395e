"""Qwen3-MoE on megatron-core in every layout, against transformers (issue 38).

One 2-rank gloo group runs every case (parallel.testing.run_cases).  Layouts: d1 (one rank),
t2 (experts split over tp like a dense MLP), p2, d2e2 (two data-parallel ranks holding half the
experts each; tokens reach their experts through megatron's all-to-all dispatcher over gloo) and
d1t2e2 (the tensor-parallel ranks hold half the experts each).  Per layout:

1. packed varlen fp32 logits (one micro-batch and several uneven ones) equal transformers'
   ``Qwen3MoeForCausalLM`` within LOGIT_ATOL;
2. ``save_hf`` from that layout reloads in transformers bit-identical to the original.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from parallel.testing import make_tiny_hf, run_cases

MODULE = __name__.rsplit(".", 1)[-1]
WORLD = 2
LOGIT_ATOL = 1e-5
MODEL = dict(family="qwen3_moe", vocab_size=100, hidden_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
LAYOUTS = {"d1": "d1", "t2": "t2", "p2": "p2", "d2e2": "d2e2", "d1t2e2": "d1t2e2"}
SEQLENS = [5, 17, 1, 9, 30]
BUDGETS = (None, 20)
CASES = ["case_setup"] + [f"case_{lay}" for lay in LAYOUTS]


def _ids():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, MODEL["vocab_size"], (sum(SEQLENS),), generator=g)


def _path(ctx, name="moe"):
    return os.path.join(ctx.tmpdir, name)


def case_setup(ctx):
    """Rank 0: the checkpoint and transformers' reference logits."""
    err = None
    if ctx.rank == 0:
        try:
            from safetensors.torch import save_file

            kw = dict(MODEL)
            _, model = make_tiny_hf(_path(ctx), seed=3, **kw)
            ctx.cache["hf"] = model
            ids, chunks, o = _ids(), [], 0
            with torch.no_grad():
                for n in SEQLENS:
                    chunks.append(model(ids[o:o + n][None]).logits[0].float())
                    o += n
            save_file({"logits": torch.cat(chunks).contiguous()}, _path(ctx, "ref.safetensors"))
        except Exception as e:  # noqa: BLE001 - raised after the barrier
            err = e
    dist.barrier()
    if err is not None:
        raise err


def _check_reload(ctx, out):
    from transformers import AutoModelForCausalLM

    orig = ctx.cache["hf"]
    got, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k != "error_msgs"}
    assert not bad and not info.get("error_msgs"), info
    a, b = orig.state_dict(), got.state_dict()
    assert sorted(a) == sorted(b), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _run(ctx, layout):
    from safetensors.torch import load_file

    from parallel.engine import MegatronEngine
    from parallel.groups import build_model_groups
    from realflow.api.allocation import parse_strategy

    s = parse_strategy(LAYOUTS[layout])
    groups = build_model_groups(list(range(s.world_size)), s)
    if not groups.is_member:
        return None
    eng = MegatronEngine(_path(ctx), groups, _path(ctx), optimizer_config=None, seed=1)
    ids, res, problems = _ids(), {}, []
    ref = load_file(_path(ctx, "ref.safetensors"))["logits"]
    for budget in BUDGETS:
        out = eng.forward(ids, SEQLENS, max_tokens_per_mb=budget)
        if out is not None:
            err = res[f"max_abs_err_mb{budget}"] = (out - ref).abs().max().item()
            if err > LOGIT_ATOL:
                problems.append(f"budget={budget}: max abs logit error {err}")
    out_dir = _path(ctx, f"saved_{layout}")
    eng.save_hf(out_dir)
    assert not problems, f"{layout}: {problems}"
    if ctx.rank == 0:
        _check_reload(ctx, out_dir)
    return res or None


for _lay in LAYOUTS:
    globals()[f"case_{_lay}"] = (lambda lay: lambda ctx: _run(ctx, lay))(_lay)


@pytest.fixture(scope="module")
def results():
    return run_cases([f"{MODULE}:{c}" for c in CASES], world_size=WORLD, timeout=300,
                     pg_timeout=120, pythonpath=[os.path.dirname(__file__)])


@pytest.mark.timeout(360)
@pytest.mark.parametrize("case", CASES)
def test_moe_layouts(results, case):
    r = results[case]
    print(f"{case}: {r.seconds:.1f}s {[d for d in r.data.values() if d]}")
    assert r.ok, r.error
