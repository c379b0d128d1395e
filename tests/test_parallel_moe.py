"""Qwen3-MoE on megatron-core in every layout, against transformers (issue 38).

One 2-rank gloo group runs every case (parallel.testing.run_cases).  Layouts: d1 (one rank),
t2 (experts split over tp like a dense MLP), p2, d2e2 (two data-parallel ranks holding half the
experts each; tokens reach their experts through megatron's all-to-all dispatcher over gloo) and
d1t2e2 (the tensor-parallel ranks hold half the experts each).  Per layout:

1. packed varlen fp32 logits (one micro-batch and several uneven ones) equal transformers'
   ``Qwen3MoeForCausalLM`` within LOGIT_ATOL;
2. routing replay: the reference "generator" is transformers' model whose top-k choice is
   forced to the experts a PERTURBED router picks (so ~a third of the tokens' expert sets
   differ from what the true router picks, as numerics flip them between engines), mixing with
   the true router's weights.  The trainer (true weights) with those experts replayed gives the
   generator's log-probs within LOGIT_ATOL; without replay it does not (shown by a gap > 1e-3);
3. one train step (summed NLL + HF's load-balancing loss, coefficient router_aux_loss_coef):
   loss, aux loss and gradient norm equal transformers' autograd of the same objective, and on
   dp = 1 layouts every gathered gradient (router and experts included) within GRAD_RTOL (p2:
   the aux loss is HF's over each stage's layers, summed; see parallel.moe_step);
4. ``save_hf`` from that layout reloads in transformers bit-identical to the original (before
   the step);

and reallocation through d2e2 -> t2 -> d1t2e2 -> p2 -> d2 -> d2e2 is exact (``case_realloc``).
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
GRAD_RTOL = 1e-5  # max abs error over the largest reference gradient
MODEL = dict(family="qwen3_moe", vocab_size=100, hidden_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
LAYOUTS = {"d1": "d1", "t2": "t2", "p2": "p2", "d2e2": "d2e2", "d1t2e2": "d1t2e2"}
SEQLENS = [5, 17, 1, 9, 30, 12]
BUDGETS = (None, 20)
CASES = ["case_setup"] + [f"case_{lay}" for lay in LAYOUTS] + ["case_realloc"]


def _ids():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, MODEL["vocab_size"], (sum(SEQLENS),), generator=g)


def _seqs():
    ids, out, o = _ids(), [], 0
    for n in SEQLENS:
        out.append(ids[o:o + n])
        o += n
    return out


def _path(ctx, name="moe"):
    return os.path.join(ctx.tmpdir, name)


# --------------------------------------------------------------------------- references (rank 0)


def _topk_routes(router_logits, k):
    """transformers' router choice: [tokens, layers, k] (sorted ids)."""
    return torch.stack([torch.topk(torch.softmax(r.float(), -1), k).indices for r in router_logits],
                       1).sort(-1).values


class _ForcedRouting:
    """transformers' Qwen3-MoE router, its top-k replaced by given experts (per layer)."""

    def __init__(self, model, routes):  # routes [tokens, layers, k]
        from transformers.models.qwen3_moe import modeling_qwen3_moe as m

        self.cls, self.orig, self.routes = m.Qwen3MoeTopKRouter, m.Qwen3MoeTopKRouter.forward, routes
        for i, layer in enumerate(model.model.layers):
            layer.mlp.gate._layer = i

    def __enter__(self):
        routes = self.routes

        def forward(router, hidden):
            hidden = hidden.reshape(-1, router.hidden_dim)
            logits = torch.nn.functional.linear(hidden, router.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            idx = routes[:, router._layer].to(torch.long)
            val = probs.gather(1, idx)
            if router.norm_topk_prob:
                val = val / val.sum(-1, keepdim=True)
            return logits, val.to(logits.dtype), idx

        self.cls.forward = forward

    def __exit__(self, *exc):
        self.cls.forward = self.orig


def _seq_logprobs(logits, ids):
    lp = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, ids[1:, None])[:, 0]
    return torch.cat([lp, lp.new_zeros(1)])


def _make_references(ctx):
    import copy

    from safetensors.torch import save_file

    cfg, model = make_tiny_hf(_path(ctx), seed=3, **MODEL)
    ctx.cache["hf"] = model
    k = cfg.num_experts_per_tok
    seqs, ref = _seqs(), {}
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        for layer in perturbed.model.layers:
            w = layer.mlp.gate.weight
            w.add_(0.35 * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(7)))
        logits, own, forced, lp_gen = [], [], [], []
        for s in seqs:
            out = model(s[None], output_router_logits=True)
            logits.append(out.logits[0].float())
            own.append(_topk_routes(out.router_logits, k))
            forced.append(_topk_routes(perturbed(s[None], output_router_logits=True).router_logits, k))
            with _ForcedRouting(model, forced[-1]):
                lp_gen.append(_seq_logprobs(model(s[None]).logits[0], s))
    ref["logits"] = torch.cat(logits)
    ref["routes"] = torch.cat(forced).to(torch.int16)
    ref["lp_gen"] = torch.cat(lp_gen)
    differ = (torch.cat(own) != torch.cat(forced)).any(-1).float().mean()
    assert differ > 0.15, f"the perturbed router must change many choices, changed {float(differ):.2f}"
    ref["routes_differ"] = differ[None]
    for dp, pp in ((1, 1), (2, 1), (1, 2)):
        grads, loss, aux, norm = _train_reference(copy.deepcopy(model), seqs, dp, pp, cfg)
        p = f"dp{dp}pp{pp}_"
        ref.update({p + "loss": loss[None], p + "aux": aux[None], p + "norm": norm[None]})
        ref.update({f"{p}grad.{n}": g for n, g in grads.items()})
    save_file({k_: v.contiguous() for k_, v in ref.items()}, _path(ctx, "ref.safetensors"))


def _shards(seqs, dp):
    return [seqs[r::dp] for r in range(dp)]


def _train_reference(model, seqs, dp, pp, cfg):
    """transformers' autograd of the engine's objective: per micro-batch (= dp shard here)
    summed NLL + coef * (its loss weight) * HF aux loss (padded batch, attention mask), / W.
    With ``pp`` stages the aux loss is HF's over each stage's layers, summed (the engine's
    stage-local form, parallel.moe_step)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model.train()
    total_w = sum(len(s) - 1 for s in seqs)
    objective, nll_sum, aux_sum = 0.0, 0.0, 0.0
    for shard in _shards(seqs, dp):
        n = max(len(s) for s in shard)
        ids = torch.stack([torch.cat([s, s.new_zeros(n - len(s))]) for s in shard])
        mask = torch.stack([torch.arange(n) < len(s) for s in shard]).long()
        out = model(ids, attention_mask=mask, output_router_logits=True)
        nll = sum(-_seq_logprobs(out.logits[i, :len(s)], s).sum() for i, s in enumerate(shard))
        w = sum(len(s) - 1 for s in shard)
        per_stage = len(out.router_logits) // pp
        aux = sum(load_balancing_loss_func(out.router_logits[i:i + per_stage], cfg.num_experts,
                                           cfg.num_experts_per_tok, mask)
                  for i in range(0, len(out.router_logits), per_stage))
        if pp == 1:
            assert torch.allclose(aux, out.aux_loss), (aux, out.aux_loss)  # HF's own
        objective = objective + nll + cfg.router_aux_loss_coef * w * aux
        nll_sum, aux_sum = nll_sum + float(nll), aux_sum + float(aux)
    (objective / total_w).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))
    return _per_expert_names(grads), torch.tensor(nll_sum / total_w), torch.tensor(aux_sum / dp), norm.float()


def _per_expert_names(grads):
    """transformers keeps experts fused ([E, 2f, h] gate_up, [E, h, f] down); checkpoints (and
    realflow) name each expert's tensors."""
    out = {}
    for n, g in grads.items():
        if n.endswith("mlp.experts.gate_up_proj"):
            base, f = n[: -len("gate_up_proj")], g.shape[1] // 2
            for j in range(g.shape[0]):
                out[f"{base}{j}.gate_proj.weight"], out[f"{base}{j}.up_proj.weight"] = g[j, :f], g[j, f:]
        elif n.endswith("mlp.experts.down_proj"):
            base = n[: -len("down_proj")]
            for j in range(g.shape[0]):
                out[f"{base}{j}.down_proj.weight"] = g[j]
        else:
            out[n] = g
    return out


def case_setup(ctx):
    err = None
    if ctx.rank == 0:
        try:
            _make_references(ctx)
        except Exception as e:  # noqa: BLE001 - raised after the barrier
            err = e
    dist.barrier()
    if err is not None:
        raise err


# --------------------------------------------------------------------------- layouts


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


def nll_loss(out, extra):
    return -(out.logprobs(extra["targets"]) * extra["mask"]).sum(), {}


def nll_weight(extra):
    return float(extra["mask"].sum())


def _micro_batches(shard):
    ids = torch.cat(shard)
    targets = torch.cat([torch.cat([s[1:], s.new_zeros(1)]) for s in shard])
    mask = torch.cat([torch.cat([torch.ones(len(s) - 1), torch.zeros(1)]) for s in shard])
    return [(ids, [len(s) for s in shard], {"targets": targets, "mask": mask})]


def _run(ctx, layout):
    from safetensors.torch import load_file

    from parallel.engine import MegatronEngine
    from parallel.groups import build_model_groups
    from parallel.optim import EngineOptimizerConfig
    from realflow.api.allocation import parse_strategy

    s = parse_strategy(LAYOUTS[layout])
    groups = build_model_groups(list(range(s.world_size)), s)
    if not groups.is_member:
        return None
    opt = EngineOptimizerConfig(lr=1e-3, weight_decay=0.0, warmup_steps_proportion=0.0,
                                lr_scheduler_type="constant", gradient_clipping=100.0, total_train_steps=1)
    eng = MegatronEngine(_path(ctx), groups, _path(ctx), optimizer_config=opt, seed=1)
    ids, res, problems = _ids(), {}, []
    ref = load_file(_path(ctx, "ref.safetensors"))
    for budget in BUDGETS:
        out = eng.forward(ids, SEQLENS, max_tokens_per_mb=budget)
        replayed = eng.logprobs(ids, SEQLENS, budget, routed_experts=ref["routes"])
        own = eng.logprobs(ids, SEQLENS, budget)
        if out is not None:
            res[f"logits_err_mb{budget}"] = err = (out - ref["logits"]).abs().max().item()
            res[f"r3_err_mb{budget}"] = r3 = (replayed - ref["lp_gen"]).abs().max().item()
            res[f"no_r3_gap_mb{budget}"] = gap = (own - ref["lp_gen"]).abs().max().item()
            if err > LOGIT_ATOL or r3 > LOGIT_ATOL or gap < 1e-3:
                problems.append(f"budget={budget}: logits {err}, with replay {r3}, without {gap}")
    out_dir = _path(ctx, f"saved_{layout}")
    eng.save_hf(out_dir)
    assert not problems, f"{layout}: {problems}"
    if ctx.rank == 0:
        _check_reload(ctx, out_dir)
    shard = _shards(_seqs(), s.dp)[groups.dp_rank]
    stats = eng.train_batch(_micro_batches(shard), nll_loss, nll_weight)
    res.update({k: stats[k] for k in ("loss", "grad_norm", "moe/aux_loss", "moe/expert_load")})
    p = f"dp{s.dp}pp{s.pp}_"
    assert abs(stats["loss"] - float(ref[p + "loss"])) <= 1e-5 * abs(float(ref[p + "loss"])), (stats, ref[p + "loss"])
    assert abs(stats["moe/aux_loss"] - float(ref[p + "aux"])) <= 1e-5, (stats, ref[p + "aux"])
    assert abs(stats["grad_norm"] - float(ref[p + "norm"])) <= 1e-5 * float(ref[p + "norm"]), (stats, ref[p + "norm"])
    if s.dp == 1:
        grads = eng.full_hf_grads()
        if grads is not None:
            want = {n[len(p + "grad."):]: g for n, g in ref.items() if n.startswith(p + "grad.")}
            assert sorted(grads) == sorted(want), set(grads) ^ set(want)
            scale = max(g.abs().max().item() for g in want.values())
            res["grad_rel"] = max((grads[n] - g).abs().max().item() for n, g in want.items()) / scale
            assert res["grad_rel"] <= GRAD_RTOL, res
    return res


for _lay in LAYOUTS:
    globals()[f"case_{_lay}"] = (lambda lay: lambda ctx: _run(ctx, lay))(_lay)

REALLOC_CHAIN = ["d2e2", "t2", "d1t2e2", "p2", "d2", "d2e2"]


def case_realloc(ctx):
    """Parameter reallocation through layouts of different expert parallelism is exact: each
    destination equals its shard (reference_shard) of the checkpoint's full tensors, and the
    shard spec names exactly the model's parameters (local expert indices included)."""
    from parallel.groups import build_model_groups
    from parallel.hf_io import hf_to_mcore, load_hf_checkpoint, param_table, read_hf_tensors
    from parallel.model import build_gpt_model
    from parallel.model_config import hf_arch
    from parallel.realloc import plan_reallocation, prepare_reallocation, reallocate, reference_shard, shard_spec
    from realflow.api.allocation import parse_strategy
    from realflow.api.layout import Layout
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(_path(ctx))
    arch = hf_arch(cfg)
    hf = read_hf_tensors(_path(ctx))
    full = {e.mcore_name: hf_to_mcore(e, [hf[n] for n in e.hf_names], arch.vocab_size, cfg.num_key_value_heads)
            for e in param_table(cfg, arch)}
    models, moved = [], 0
    for name in REALLOC_CHAIN:
        lay = Layout((0, 1), parse_strategy(name))
        groups = build_model_groups([0, 1], lay.strategy)
        model = build_gpt_model(cfg, groups)[0]
        spec = shard_spec(cfg, lay)[ctx.rank]
        params = dict(model.named_parameters())
        assert sorted(params) == sorted(sh.local_name for sh in spec.values()), name
        if not models:
            load_hf_checkpoint(model, _path(ctx), cfg, hf_arch(cfg, tp_size=lay.strategy.tp),
                               groups.tp_rank, lay.strategy.tp)
        else:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(13.0)
            src_model, src_lay = models[-1]
            plan = plan_reallocation(cfg, src_lay, lay, torch.float32)
            res = prepare_reallocation(plan, timeout=60)
            reallocate(plan, res, src_model, model, timeout=60)
            res.close()
        for n, sh in spec.items():
            assert torch.equal(params[sh.local_name], reference_shard(sh, full[n])), (name, sh.local_name)
            moved += 1
        models.append((model, lay))
    return {"checked": moved}


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
