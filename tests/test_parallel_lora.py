"""LoRA on the megatron engine == PEFT's LoRA on the same HF model, in d1, t2, p2 and t2p2.

ONE 4-rank gloo group (parallel.testing). Rank 0 makes a tiny Qwen2 (tied embeddings, 8 heads,
4 KV heads: qkv adapters land in grouped rows), wraps it in ``peft.get_peft_model`` with random
A and B on all seven linears, saves the adapter with PEFT and computes the references. Each
layout then loads the base checkpoint + PEFT's adapter and checks:

* logits == PEFT's within OUT_ATOL; the reference with adapters off == the base model's log-probs;
* one train step: loss and every adapter gradient == PEFT's (GRAD_TOL relative); the base is
  bit-identical afterwards, only adapters moved; the optimizer holds adapter parameters only;
* saving writes PEFT's format: ``peft.PeftModel.from_pretrained`` loads it, and an adapter
  loaded and saved back is bit-identical to PEFT's file; ``save_merged`` writes a checkpoint
  whose logits == PEFT's ``merge_and_unload`` model;
* a generation engine updated with adapters only (merged into its base) generates exactly what
  one loaded from the merged checkpoint generates (greedy tokens and log-probs bit-identical), and
  its log-probs equal the trainer's; the trainer's own generator (merged weights) agrees too.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from parallel.testing import make_tiny_hf, run_cases

MODULE = __name__.rsplit(".", 1)[-1]
WORLD = 4
OUT_ATOL = 2e-5
GRAD_TOL = 1e-5
TINY = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
R, ALPHA = 4, 8.0
LAYOUTS = [(1, 1, 1), (1, 2, 1), (1, 1, 2), (1, 2, 2), (2, 2, 1)]
CASES = (["case_setup"] + [f"case_layout_d{d}t{t}p{p}" for d, t, p in LAYOUTS]
         + ["case_qv_only_t2", "case_generation_with_adapter_updates"])


def _batch():
    g = torch.Generator().manual_seed(7)
    lens = [9, 3, 14, 6]
    ids = torch.randint(0, TINY["vocab_size"], (sum(lens),), generator=g)
    return ids, lens


def _targets(ids, lens):
    out, off = [], 0
    for n in lens:
        s = ids[off:off + n]
        out.append(torch.cat([s[1:], s[:1]]))
        off += n
    return torch.cat(out)


def _mask(lens):
    m = []
    for n in lens:
        m += [1.0] * (n - 1) + [0.0]
    return torch.tensor(m)


def _peft_model(tmp, targets):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(os.path.join(tmp, "base"), dtype=torch.float32)
    cfg = LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=targets,
                     init_lora_weights=False, task_type="CAUSAL_LM")
    torch.manual_seed(11)
    return get_peft_model(base, cfg)


def _seq_logits(model, ids, lens):
    chunks, off = [], 0
    for n in lens:
        chunks.append(model(input_ids=ids[off:off + n][None]).logits[0].float())
        off += n
    return torch.cat(chunks)


def _references(tmp, targets, tag):
    from peft.utils import get_peft_model_state_dict

    model = _peft_model(tmp, targets)
    model.save_pretrained(os.path.join(tmp, f"peft_{tag}"))
    ids, lens = _batch()
    tg, mask = _targets(ids, lens), _mask(lens)
    ref = {}
    with torch.no_grad():
        ref["logits"] = _seq_logits(model, ids, lens)
        with model.disable_adapter():
            base_lp = torch.log_softmax(_seq_logits(model, ids, lens), -1)
        ref["base_lp"] = base_lp.gather(-1, tg[:, None])[:, 0] * mask
    model.train()
    logp = torch.log_softmax(_seq_logits(model, ids, lens), -1).gather(-1, tg[:, None])[:, 0]
    loss = -(mask * logp).sum() / mask.sum()
    loss.backward()
    ref["loss"] = torch.tensor([float(loss)])
    for n, p in model.named_parameters():
        if p.grad is not None:
            ref["grad/" + n.replace(".default", "")] = p.grad.detach().clone()
    model.eval()
    with torch.no_grad():
        greedy = []
        for prompt in ([5, 6, 7], [9]):
            seq = list(prompt)
            for _ in range(4):
                seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
            greedy.append(seq[len(prompt):])
        ref["greedy"] = torch.tensor(greedy)
        merged = model.merge_and_unload()
        ref["merged_logits"] = _seq_logits(merged, ids, lens)
    assert set(get_peft_model_state_dict(_peft_model(tmp, targets)))  # PEFT names exist
    return ref


def case_setup(ctx):
    if ctx.rank == 0:
        from safetensors.torch import save_file

        make_tiny_hf(os.path.join(ctx.tmpdir, "base"), "qwen2", seed=3, tie_word_embeddings=True, **TINY)
        save_file(_references(ctx.tmpdir, TARGETS, "all"), os.path.join(ctx.tmpdir, "ref_all.safetensors"))
        save_file(_references(ctx.tmpdir, ["q_proj", "v_proj"], "qv"), os.path.join(ctx.tmpdir, "ref_qv.safetensors"))
    dist.barrier()


def _engine(ctx, layout, targets, tag):
    from parallel.engine import MegatronEngine
    from parallel.groups import ParallelStrategy, build_model_groups
    from parallel.optim import EngineOptimizerConfig
    from realflow.api.model_options import LoRAConfig

    dp, tp, pp = layout
    groups = build_model_groups(list(range(dp * tp * pp)), ParallelStrategy(dp=dp, tp=tp, pp=pp))
    if not groups.is_member:
        return None
    opt = EngineOptimizerConfig(lr=1e-2, weight_decay=0.0, warmup_steps_proportion=0.0,
                                lr_scheduler_type="constant", min_lr_ratio=0.0, gradient_clipping=0.0,
                                total_train_steps=2)
    lora = LoRAConfig(enabled=True, r=R, alpha=ALPHA, dropout=0.0, target_modules=targets,
                      path=os.path.join(ctx.tmpdir, f"peft_{tag}"))
    base = os.path.join(ctx.tmpdir, "base")
    return MegatronEngine(base, groups, base, opt, seed=1, lora=lora)


def _ref(ctx, tag):
    from safetensors.torch import load_file

    return load_file(os.path.join(ctx.tmpdir, f"ref_{tag}.safetensors"))


def _loss(out, extra):
    targets, mask = extra
    return -(mask * out.logprobs(targets)).sum(), {}


def _check_layout(ctx, layout, targets, tag):
    from safetensors.torch import load_file

    eng = _engine(ctx, layout, targets, tag)
    if eng is None:
        dist.barrier()
        return {}
    dp, tp, pp = layout
    ref = _ref(ctx, tag)
    ids, lens = _batch()
    res: dict = {}
    logits = eng.forward(ids, lens)
    with eng.adapters_disabled():
        base_lp = eng.logprobs(ids, lens)
    if eng.is_output_rank:
        res["logits_err"] = (logits - ref["logits"]).abs().max().item()
        res["base_lp_err"] = (base_lp - ref["base_lp"]).abs().max().item()
    # the base is frozen: only adapters train, and the optimizer holds adapters only
    res["trainable_non_adapters"] = [n for n, p in eng.module.named_parameters() if p.requires_grad and ".lora_" not in n]
    adapter_elems = sum(p.numel() for n, p in eng.module.named_parameters() if ".lora_" in n)
    opt_params = [p for g in eng.optimizer.optimizer.param_groups for p in g["params"]]
    res["opt_elems"] = sum(p.numel() for p in opt_params)
    assert res["opt_elems"] <= adapter_elems, (res["opt_elems"], adapter_elems)
    base_before = eng.full_hf_state(adapters_merged=False)
    tg, mask = _targets(ids, lens), _mask(lens)
    if dp == 1:
        mbs = [(ids, lens, (tg, mask))]
    else:  # sequences 0,1 on dp 0, 2,3 on dp 1
        cut = lens[0] + lens[1]
        mine = (slice(0, cut), lens[:2]) if eng.groups.dp_rank == 0 else (slice(cut, None), lens[2:])
        mbs = [(ids[mine[0]], mine[1], (tg[mine[0]], mask[mine[0]]))]
    stats = eng.train_batch(mbs, _loss, lambda e: float(e[1].sum()))
    res["loss_err"] = abs(stats["loss"] - float(ref["loss"][0]))
    if dp == 1:
        grads = eng.full_hf_grads()
        if grads is not None:
            gref = {k[len("grad/"):]: v for k, v in ref.items() if k.startswith("grad/")}
            assert set(grads) == set(gref), (sorted(set(grads) ^ set(gref)))[:4]
            scale = max(v.abs().max().item() for v in gref.values())
            res["grad_err"] = max((grads[k] - gref[k]).abs().max().item() for k in gref) / scale
    base_after = eng.full_hf_state(adapters_merged=False)
    if base_after is not None:
        res["base_changed"] = sorted(k for k in base_after if not torch.equal(base_after[k], base_before[k]))
    out = os.path.join(ctx.tmpdir, f"saved_d{dp}t{tp}p{pp}_{tag}")
    eng.lora.cfg.save_merged = True
    eng.save_hf(out)
    if ctx.rank == 0:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        saved = load_file(os.path.join(out, "adapter_model.safetensors"))
        base = AutoModelForCausalLM.from_pretrained(os.path.join(ctx.tmpdir, "base"), dtype=torch.float32)
        peft_model = PeftModel.from_pretrained(base, out)
        from peft.utils import get_peft_model_state_dict

        back = get_peft_model_state_dict(peft_model)
        res["peft_reload_equal"] = set(back) == set(saved) and all(torch.equal(back[k], saved[k]) for k in saved)
        merged = AutoModelForCausalLM.from_pretrained(os.path.join(out, "merged"), dtype=torch.float32)
        peft_merged = peft_model.merge_and_unload()
        with torch.no_grad():
            res["merged_vs_peft_merge"] = (_seq_logits(merged, ids, lens)
                                           - _seq_logits(peft_merged, ids, lens)).abs().max().item()
    dist.barrier()
    return res


def _layout_case(layout):
    def case(ctx):
        res = _check_layout(ctx, layout, TARGETS, "all")
        if not res:
            return res
        for key, tol in (("logits_err", OUT_ATOL), ("base_lp_err", OUT_ATOL), ("loss_err", 1e-5),
                         ("grad_err", GRAD_TOL), ("merged_vs_peft_merge", OUT_ATOL)):
            if key in res:
                assert res[key] <= tol, f"{layout} {key}={res[key]:.3g} > {tol}"
        assert res.get("base_changed", []) == [], res["base_changed"][:3]
        assert res["trainable_non_adapters"] == [], res["trainable_non_adapters"][:3]
        if "peft_reload_equal" in res:
            assert res["peft_reload_equal"], "PEFT's reload of realflow's adapter differs"
        return res
    return case


for _d, _t, _p in LAYOUTS:
    globals()[f"case_layout_d{_d}t{_t}p{_p}"] = _layout_case((_d, _t, _p))


def case_qv_only_t2(ctx):
    """q and v only (k untouched in the fused qkv rows), and a PEFT-saved adapter loaded then
    saved back unchanged is bit-identical to PEFT's file."""
    from safetensors.torch import load_file

    eng = _engine(ctx, (1, 2, 1), ["q_proj", "v_proj"], "qv")
    res: dict = {}
    if eng is not None:
        ids, lens = _batch()
        logits = eng.forward(ids, lens)
        out = os.path.join(ctx.tmpdir, "qv_roundtrip")
        eng.save_hf(out)
        if eng.is_output_rank:
            res["logits_err"] = (logits - _ref(ctx, "qv")["logits"]).abs().max().item()
            assert res["logits_err"] <= OUT_ATOL, res
        if ctx.rank == 0:
            a = load_file(os.path.join(ctx.tmpdir, "peft_qv", "adapter_model.safetensors"))
            b = load_file(os.path.join(out, "adapter_model.safetensors"))
            assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), "round trip changed the adapter"
            res["roundtrip_equal"] = True
    dist.barrier()
    return res


@pytest.fixture(scope="module")
def results():
    return run_cases([f"{MODULE}:{c}" for c in CASES], world_size=WORLD, timeout=600, pg_timeout=120,
                     pythonpath=[os.path.dirname(__file__)])


@pytest.mark.timeout(660)
@pytest.mark.parametrize("case", CASES)
def test_lora_matches_peft(results, case):
    r = results[case]
    assert r.ok, r.error


def case_generation_with_adapter_updates(ctx):
    """After a train step: the adapters alone update a generation engine loaded with the base."""
    from parallel.generation import GenerationEngine
    from realflow.api.generation import SamplingParams

    eng = _engine(ctx, (1, 1, 1), TARGETS, "all")
    res: dict = {}
    if eng is not None:
        ids, lens = _batch()
        eng.train_batch([(ids, lens, (_targets(ids, lens), _mask(lens)))], _loss, lambda e: float(e[1].sum()))
        adapters = eng.adapter_state()
        merged_dir = os.path.join(ctx.tmpdir, "gen_merged")
        eng.lora.cfg.save_merged = True
        eng.save_hf(os.path.join(ctx.tmpdir, "gen_adapter"))
        os.replace(os.path.join(ctx.tmpdir, "gen_adapter", "merged"), merged_dir)
        served = GenerationEngine.from_hf(os.path.join(ctx.tmpdir, "base"), tokenizer=None)
        served.update_weights_from_tensors(served.merged_adapter_update(adapters, eng.lora.cfg.scaling), version=1)
        loaded = GenerationEngine.from_hf(merged_dir, tokenizer=None)
        prompts = [[5, 6, 7], [9], [11, 12, 13, 14, 15]]
        sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        a, b = served.generate(prompts, sp), loaded.generate(prompts, sp)
        assert [r.output_ids for r in a] == [r.output_ids for r in b]
        assert [r.output_logprobs for r in a] == [r.output_logprobs for r in b], "not bit-identical"
        seqs = [r.prompt_ids + r.output_ids for r in a]
        lp = eng.logprobs(torch.tensor([t for s_ in seqs for t in s_]), [len(s_) for s_ in seqs])
        off, err = 0, 0.0
        for r, s_ in zip(a, seqs):
            n = len(r.prompt_ids)
            mine = lp[off + n - 1: off + len(s_) - 1]
            err = max(err, (mine - torch.tensor(r.output_logprobs)).abs().max().item())
            off += len(s_)
        res["server_vs_trainer_lp"] = err
        assert err <= OUT_ATOL, err
        own = eng.generator(64, version=eng.version).generate(prompts, sp)  # the trainer's own sampler
        assert [r.output_ids for r in own] == [r.output_ids for r in a]
        # disk sync: the adapter directory the run saves, applied by a server started from the base
        from_disk = GenerationEngine.from_hf(os.path.join(ctx.tmpdir, "base"), tokenizer=None)
        from_disk.update_weights_from_disk(os.path.join(ctx.tmpdir, "gen_adapter"), version=1)
        c = from_disk.generate(prompts, sp)
        assert [r.output_logprobs for r in c] == [r.output_logprobs for r in b], "adapter dir != merged"
    dist.barrier()
    return res
