"""MegatronEngine in every (dp, tp, pp) layout == the single-process model.

ONE 8-rank gloo group runs every case (parallel.testing).  The tiny Qwen2 model
(4 layers, 8 heads, 4 kv heads, hidden 64, vocab 100, TIED embeddings, so
pp > 1 exercises the embedding <-> LM-head all-reduce across stages) is laid out
as t1p1, t2p1, t1p2, t2p2, t4p1, t1p4, each with d1 and d2 where it fits in 8
ranks.  tp > 1 runs with sequence parallelism; pp > 1 with megatron's 1F1B
schedule over p2p; log-probs / entropy are vocab-parallel.  References are
plain PyTorch on transformers (computed once on rank 0):

* fp32 logits, log-probs, entropy within OUT_ATOL of transformers;
* HF save right after loading is bit-identical to the original checkpoint;
* gradients after one step (dp = 1 layouts: gathered main grads) within
  GRAD_TOL relative to the largest reference gradient; loss and grad norm each
  step; parameters after STEPS AdamW steps within PARAM_ATOL;
* critic (``*ForTokenClassification``, 1 label) in several layouts: values,
  training, save; a critic initialised from the LM checkpoint;
* layouts that cannot hold the model and mismatched checkpoints fail cleanly.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from parallel.testing import make_tiny_hf, run_cases

MODULE = __name__.rsplit(".", 1)[-1]
WORLD = 8
OUT_ATOL = 2e-5  # logits / log-probs / entropy / values vs transformers, fp32
GRAD_TOL = 1e-5  # max |g - g_ref| / max |g_ref|
# after STEPS AdamW steps at lr 2e-3: gradients agree to ~1e-7 relative, but Adam
# divides by sqrt(v), so a parameter whose gradient is ~1e-8 moves by ~lr either
# way and last-bit differences show up amplified; 1e-4 = 5% of one step's lr.
PARAM_ATOL = 1e-4
LOSS_RTOL = 1e-5
STEPS = 3
ENT_COEF = 0.01
TINY = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
# (dp, tp, pp)
LAYOUTS = [(1, 1, 1), (1, 2, 1), (1, 1, 2), (1, 2, 2), (1, 4, 1), (1, 1, 4),
           (2, 1, 1), (2, 2, 1), (2, 1, 2), (2, 2, 2), (2, 4, 1), (2, 1, 4)]
GREEDY_PROMPTS = [[5, 6, 7], [9]]
CRITIC_LAYOUTS = [(1, 2, 2), (2, 1, 2), (2, 2, 1), (1, 1, 4)]
CASES = (["case_setup"] + [f"case_layout_d{d}t{t}p{p}" for d, t, p in LAYOUTS]
         + [f"case_critic_d{d}t{t}p{p}" for d, t, p in CRITIC_LAYOUTS]
         + ["case_critic_from_lm", "case_bad_layouts"])


# --------------------------------------------------------------------------- data


def _eval_batch():
    g = torch.Generator().manual_seed(5)
    lens = [7, 1, 19, 4, 12, 9]
    return torch.randint(0, TINY["vocab_size"], (sum(lens),), generator=g), lens


def _global_batch(step: int):
    """6 sequences (ids, targets, loss mask), lengths 3..20."""
    g = torch.Generator().manual_seed(100 + step)
    seqs = []
    for _ in range(6):
        n = int(torch.randint(3, 21, (1,), generator=g))
        ids = torch.randint(0, TINY["vocab_size"], (n,), generator=g)
        targets = torch.cat([ids[1:], ids[:1]])
        mask = (torch.rand(n, generator=g) < 0.8).float()
        mask[-1] = 0.0
        seqs.append((ids, targets, mask))
    return seqs


def _split(seqs, dp: int, dp_rank: int):
    """This dp rank's micro-batches: uneven shapes so pp has to pad to a common one."""
    if dp == 1:
        groups = [seqs[0:2], seqs[2:5], seqs[5:6]]
    else:
        mine = seqs[3 * dp_rank: 3 * dp_rank + 3]
        groups = [mine[0:1], mine[1:3]]
    return [(torch.cat([s[0] for s in grp]), [len(s[0]) for s in grp],
             (torch.cat([s[1] for s in grp]), torch.cat([s[2] for s in grp]))) for grp in groups]


def lm_loss(out, extra):
    """PPO-flavoured: -logp and an entropy bonus, both vocab-parallel."""
    targets, mask = extra
    logp, ent = out.logprobs_and_entropy(targets)
    loss = -(mask * (logp + ENT_COEF * ent)).sum()
    with torch.no_grad():
        correct = ((out.argmax() == targets).float() * mask).sum()
    return loss, {"correct": float(correct)}


def critic_loss(out, extra):
    returns, mask = extra
    return (mask * (out.values() - returns) ** 2).sum(), {}


def weight(extra):
    return float(extra[1].sum())


def _opt_cfg():
    from parallel.optim import EngineOptimizerConfig

    return EngineOptimizerConfig(lr=2e-3, weight_decay=0.05, beta2=0.99, warmup_steps_proportion=0.0,
                           lr_scheduler_type="constant", min_lr_ratio=0.0, gradient_clipping=0.5,
                           total_train_steps=STEPS)


# --------------------------------------------------------------------------- references


def _torch_train(model, cfg, batches, loss_of):
    """Plain PyTorch: global weighted-mean loss, clip, AdamW (megatron's decay groups)."""
    decay = [p for n, p in model.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
    rest = [p for n, p in model.named_parameters() if not (p.dim() > 1 and not n.endswith(".bias"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    out = {"loss": [], "grad_norm": []}
    for k, seqs in enumerate(batches):
        opt.zero_grad()
        total_w = sum(float(s[2].sum()) for s in seqs)
        loss = sum(loss_of(model, s) for s in seqs) / total_w
        loss.backward()
        if k == 0:
            out["grads0"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        out["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                      cfg.gradient_clipping)))
        opt.step()
        out["loss"].append(float(loss))
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _lm_seq_loss(model, s):
    ids, targets, mask = s
    logp = torch.log_softmax(model(ids[None]).logits[0].float(), -1)
    lp = logp.gather(-1, targets[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    return -(mask * (lp + ENT_COEF * ent)).sum()


def _critic_returns(ids):
    return (ids.float() / TINY["vocab_size"]) - 0.5


def _critic_seq_loss(model, s):
    ids, _, mask = s
    v = model(ids[None]).logits[0, :, 0].float()
    return (mask * (v - _critic_returns(ids)) ** 2).sum()


def _critic_batches():
    return [[(ids, _critic_returns(ids), mask) for ids, _, mask in _global_batch(k)]
            for k in range(STEPS)]


def _references(tmp):
    from transformers import Qwen2ForCausalLM, Qwen2ForTokenClassification

    ids, lens = _eval_batch()
    ref = {}
    lm = Qwen2ForCausalLM.from_pretrained(os.path.join(tmp, "lm"), dtype=torch.float32).eval()
    with torch.no_grad():
        chunks, off = [], 0
        for n in lens:
            chunks.append(lm(ids[off:off + n][None]).logits[0].float())
            off += n
    logits = torch.cat(chunks)
    logp = torch.log_softmax(logits, -1)
    targets = torch.cat([ids[1:], ids[:1]])
    lp = logp.gather(-1, targets[:, None])[:, 0]
    ends = torch.tensor(lens).cumsum(0) - 1
    lp[ends] = 0.0
    ref.update(logits=logits, logprobs=lp, entropy=-(logp.exp() * logp).sum(-1))
    greedy = []
    with torch.no_grad():
        for prompt in GREEDY_PROMPTS:
            seq = list(prompt)
            for _ in range(3):
                seq.append(int(lm(torch.tensor([seq])).logits[0, -1].argmax()))
            greedy.append(seq[len(prompt):])
    ref["greedy"] = torch.tensor(greedy)
    lm.train()
    ref["lm"] = _torch_train(lm, _opt_cfg(), [_global_batch(k) for k in range(STEPS)], _lm_seq_loss)
    critic = Qwen2ForTokenClassification.from_pretrained(os.path.join(tmp, "critic"),
                                                         dtype=torch.float32).eval()
    with torch.no_grad():
        chunks, off = [], 0
        for n in lens:
            chunks.append(critic(ids[off:off + n][None]).logits[0, :, 0].float())
            off += n
    ref["values"] = torch.cat(chunks)
    ref["critic"] = _torch_train(critic, _opt_cfg(), _critic_batches(), _critic_seq_loss)
    return ref


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = torch.as_tensor(v, dtype=torch.float64 if isinstance(v, list)
                                                  else None).contiguous()
    return out


def _unflatten(flat):
    out: dict = {}
    for key, v in flat.items():
        *path, last = key.split("/")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = v.tolist() if v.dtype == torch.float64 else v
    return out


def _ref(ctx):
    """References, computed once by rank 0 (case_setup) and read from a safetensors file."""
    if "ref" not in ctx.cache:
        from safetensors.torch import load_file

        ctx.cache["ref"] = _unflatten(load_file(os.path.join(ctx.tmpdir, "ref.safetensors")))
    return ctx.cache["ref"]


def _max_err(a, b):
    return (a - b).abs().max().item()


# --------------------------------------------------------------------------- cases


def case_setup(ctx):
    if ctx.rank == 0:
        make_tiny_hf(os.path.join(ctx.tmpdir, "lm"), "qwen2", seed=3, tie_word_embeddings=True,
                     **TINY)
        make_tiny_hf(os.path.join(ctx.tmpdir, "critic"), "qwen2", seed=4, critic=True,
                     tie_word_embeddings=False, **TINY)
        from safetensors.torch import save_file

        save_file(_flatten(_references(ctx.tmpdir)), os.path.join(ctx.tmpdir, "ref.safetensors"))
    dist.barrier()


def _engine(ctx, layout, name, critic=False, opt=True):
    from transformers import AutoConfig

    from parallel.engine import MegatronEngine
    from parallel.groups import ParallelStrategy, build_model_groups

    dp, tp, pp = layout
    groups = build_model_groups(list(range(dp * tp * pp)), ParallelStrategy(dp=dp, tp=tp, pp=pp))
    if not groups.is_member:
        return None
    path = os.path.join(ctx.tmpdir, name)
    return MegatronEngine(AutoConfig.from_pretrained(path), groups, path,
                          _opt_cfg() if opt else None, seed=1, critic=critic)


def _check_save_exact(ctx, eng, name, tag):
    from parallel.hf_io import read_hf_tensors

    out = os.path.join(ctx.tmpdir, f"saved_{tag}")
    eng.save_hf(out)  # collective; the writer is (dp 0, tp 0, pp 0) = ranks[0]
    if eng.groups.global_rank == eng.groups.ranks[0]:
        a, b = read_hf_tensors(os.path.join(ctx.tmpdir, name)), read_hf_tensors(out)
        assert sorted(a) == sorted(b), set(a) ^ set(b)
        for k in a:
            assert torch.equal(a[k], b[k]), (tag, k)


def _run_layout(ctx, layout):
    eng = _engine(ctx, layout, "lm")
    if eng is None:
        return None
    dp, tp, pp = layout
    tag = f"d{dp}t{tp}p{pp}"
    ref = _ref(ctx)
    _check_save_exact(ctx, eng, "lm", tag)
    res = {}
    ids, lens = _eval_batch()
    logits = eng.forward(ids, lens, max_tokens_per_mb=20)
    both = eng.logprobs(ids, lens, max_tokens_per_mb=20, with_entropy=True)
    lp, ent = both if both is not None else (None, None)
    assert (logits is None) == (lp is None) == (not eng.is_output_rank)
    if eng.is_output_rank:
        res["logits"] = _max_err(logits, ref["logits"])
        res["logprobs"] = _max_err(lp, ref["logprobs"])
        res["entropy"] = _max_err(ent, ref["entropy"])
        assert max(res["logits"], res["logprobs"], res["entropy"]) <= OUT_ATOL, res
    gen = eng.greedy_generate(GREEDY_PROMPTS, max_new_tokens=3)  # on every rank
    assert gen == ref["greedy"].long().tolist(), (gen, ref["greedy"])
    rl = ref["lm"]
    for k in range(STEPS):
        stats = eng.train_batch(_split(_global_batch(k), dp, eng.groups.dp_rank), lm_loss, weight)
        assert abs(stats["loss"] - rl["loss"][k]) <= LOSS_RTOL * abs(rl["loss"][k]), (k, stats)
        assert abs(stats["grad_norm"] - rl["grad_norm"][k]) <= 1e-5 * rl["grad_norm"][k], (k, stats)
        assert stats["grad_norm"] > _opt_cfg().gradient_clipping  # clipping acts
        assert stats["n_mbs"] == (3 if dp == 1 else 4) and "correct" in stats
        if k == 0 and dp == 1:
            grads = eng.full_hf_grads()
            if grads is not None:
                # megatron clips the gradient buffer in place: g * clip / (norm + 1e-6)
                clip = min(1.0, _opt_cfg().gradient_clipping / (rl["grad_norm"][0] + 1e-6))
                scale = max(g.abs().max().item() for g in rl["grads0"].values()) * clip
                res["grad_rel"] = max(_max_err(grads[n], clip * g)
                                      for n, g in rl["grads0"].items()) / scale
                assert res["grad_rel"] <= GRAD_TOL, res
    state = eng.full_hf_state()
    if state is not None:
        assert sorted(state) == sorted(rl["params"])
        res["params"] = max(_max_err(state[n], p) for n, p in rl["params"].items())
        assert res["params"] <= PARAM_ATOL, res
    return {tag: res}


def _run_critic(ctx, layout):
    eng = _engine(ctx, layout, "critic", critic=True)
    if eng is None:
        return None
    dp, tp, pp = layout
    tag = f"critic_d{dp}t{tp}p{pp}"
    ref = _ref(ctx)
    _check_save_exact(ctx, eng, "critic", tag)
    ids, lens = _eval_batch()
    values = eng.values(ids, lens, max_tokens_per_mb=20)
    res = {}
    if eng.is_output_rank:
        res["values"] = _max_err(values, ref["values"])
        assert res["values"] <= OUT_ATOL, res
    else:
        assert values is None
    rc = ref["critic"]
    for k, seqs in enumerate(_critic_batches()):
        stats = eng.train_batch(_split(seqs, dp, eng.groups.dp_rank), critic_loss, weight)
        assert abs(stats["loss"] - rc["loss"][k]) <= LOSS_RTOL * abs(rc["loss"][k]), (k, stats)
        assert abs(stats["grad_norm"] - rc["grad_norm"][k]) <= 1e-5 * rc["grad_norm"][k]
    state = eng.full_hf_state()
    if state is not None:
        assert sorted(state) == sorted(rc["params"]), set(state) ^ set(rc["params"])
        res["params"] = max(_max_err(state[n], p) for n, p in rc["params"].items())
        assert res["params"] <= PARAM_ATOL, res
    return {tag: res}


for _d, _t, _p in LAYOUTS:
    globals()[f"case_layout_d{_d}t{_t}p{_p}"] = (lambda lay: lambda ctx: _run_layout(ctx, lay))(
        (_d, _t, _p))
for _d, _t, _p in CRITIC_LAYOUTS:
    globals()[f"case_critic_d{_d}t{_t}p{_p}"] = (lambda lay: lambda ctx: _run_critic(ctx, lay))(
        (_d, _t, _p))


def case_critic_from_lm(ctx):
    """LM checkpoint -> critic: trunk loaded, value head zero (values exactly 0)."""
    from parallel.hf_io import read_hf_tensors

    eng = _engine(ctx, (1, 2, 2), "lm", critic=True, opt=False)
    if eng is None:
        return None
    ids, lens = _eval_batch()
    values = eng.values(ids, lens)
    if eng.is_output_rank:
        assert torch.equal(values, torch.zeros(len(ids)))
    out = os.path.join(ctx.tmpdir, "critic_from_lm")
    eng.save_hf(out)
    if eng.groups.global_rank == 0:
        lm, saved = read_hf_tensors(os.path.join(ctx.tmpdir, "lm")), read_hf_tensors(out)
        assert set(saved) - set(lm) == {"score.weight", "score.bias"}
        assert not set(lm) - set(saved)  # tied LM: no lm_head to drop
        assert all(torch.equal(saved[k], lm[k]) for k in lm)
        assert not saved["score.weight"].any() and not saved["score.bias"].any()
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(out)
        assert cfg.architectures == ["Qwen2ForTokenClassification"] and cfg.num_labels == 1


def case_bad_layouts(ctx):
    from transformers import AutoConfig

    from parallel.engine import MegatronEngine
    from parallel.groups import ParallelStrategy, build_model_groups
    from parallel.hf_io import CheckpointError

    path = os.path.join(ctx.tmpdir, "lm")
    cfg = AutoConfig.from_pretrained(path)
    for strategy, pattern in [(ParallelStrategy(pp=8), r"pp=8 > num_hidden_layers=4"),
                              (ParallelStrategy(pp=3), r"not divisible by pp=3"),
                              (ParallelStrategy(tp=8), r"num_key_value_heads=4 is not divisible by tp=8")]:
        n = strategy.dp * strategy.tp * strategy.pp
        groups = build_model_groups(list(range(n)), strategy)
        if groups.is_member:
            with pytest.raises(ValueError, match=pattern):
                MegatronEngine(cfg, groups, path, None)
    # a config that does not match the checkpoint: clean error on EVERY rank, no hang
    wide = cfg.__class__(**{**cfg.to_dict(), "intermediate_size": 192})
    groups = build_model_groups(list(range(8)), ParallelStrategy(dp=2, tp=2, pp=2))
    with pytest.raises(CheckpointError, match=r"mlp\.(gate|up)_proj\.weight .* shape \[128, 64\], "
                                              r"model expects \[192, 64\]"):
        MegatronEngine(wide, groups, path, _opt_cfg())
    # a loss_fn that fails on the last stage of one replica: every rank raises, no step
    eng = MegatronEngine(cfg, groups, path, _opt_cfg())
    mbs = _split(_global_batch(0), 2, eng.groups.dp_rank)

    def broken(out, extra):
        if eng.groups.dp_rank == 1:
            raise KeyError("no_such_key")
        return lm_loss(out, extra)

    with pytest.raises(ValueError, match="loss_fn failed: KeyError|loss_fn failed on another"):
        eng.train_batch(mbs, broken, weight)
    assert eng.version == 0
    # tp/pp ranks of one replica given different micro-batches: caught before the schedule
    odd = mbs[:1] if (eng.groups.pp_rank, eng.groups.dp_rank) == (1, 0) else mbs
    with pytest.raises(ValueError, match="different micro-batches|bad input on 1 other dp"):
        eng.train_batch(odd, lm_loss, weight)
    assert eng.train_batch(mbs, lm_loss, weight)["update_successful"] == 1.0


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def results():
    return run_cases([f"{MODULE}:{c}" for c in CASES], world_size=WORLD, timeout=400,
                     pg_timeout=120, pythonpath=[os.path.dirname(__file__)])


@pytest.mark.timeout(460)
@pytest.mark.parametrize("case", CASES)
def test_layouts(results, case):
    print(f"{case}: {results[case].seconds:.1f}s {results[case].data.get(0)}")
    assert results[case].ok, results[case].error


def test_sliced_reads_equal_tp_shard(tmp_path):
    """Each tp rank's sliced read (safetensors get_slice) == tp_shard of the full tensor."""
    from safetensors import safe_open

    from parallel.hf_io import hf_to_mcore, read_hf_tensors, tp_shard
    from parallel.hf_layout import model_param_table, read_tp_slice
    from parallel.model_config import hf_arch

    cfg, _ = make_tiny_hf(str(tmp_path / "m"), "qwen2", seed=1, tie_word_embeddings=False, **TINY)
    full = read_hf_tensors(str(tmp_path / "m"))
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        for tp in (1, 2, 4):
            arch = hf_arch(cfg, tp_size=tp)
            for e in model_param_table(cfg, arch):
                whole = hf_to_mcore(e, [full[n] for n in e.hf_names], arch.padded_vocab_size, 4)
                for r in range(tp):
                    got = read_tp_slice(e, f.get_slice, r, tp, arch.padded_vocab_size, 4)
                    assert torch.equal(got, tp_shard(e, whole, r, tp)), (e.mcore_name, tp, r)
