"""Qwen2.5-VL on megatron-core in every layout, against transformers (issue 39).

A tiny random Qwen2.5-VL (2 language layers, a 2-block vision tower with one windowed and one
full-attention block) and packed sequences mixing text-only prompts, one image and two images
of different sizes (pixels through transformers' image processor). One 2-rank gloo group runs
every case (parallel.testing.run_cases). Per layout (d1, t2, p2, d2):

1. packed varlen fp32 logits with images (one micro-batch and several uneven ones; one response
   GENERATED <|image_pad|> tokens, which stay words, as in the generator) equal
   ``Qwen2_5_VLForConditionalGeneration``'s within LOGIT_ATOL, and greedy continuations (the
   engine's cache-free ``greedy_generate``, what SFT's held-out score uses) equal ``generate``'s;
2. ``save_hf`` reloads in transformers bit-identical to the original (tower included);
3. one train step (summed NLL / tokens): loss and gradient norm equal transformers' autograd,
   and (dp = 1) every gathered gradient, the vision tower's included, within GRAD_RTOL; with
   ``freeze_vision`` the tower gets no update while the language model does;

and reallocation d2 -> t2 -> p2 -> d2 moves the tower with the language model exactly.
"""
from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from parallel.testing import TINY_VL_TOKENS, make_tiny_hf, run_cases

MODULE = __name__.rsplit(".", 1)[-1]
WORLD = 2
LOGIT_ATOL = 1e-5
GRAD_RTOL = 1e-5  # max abs error over the largest reference gradient
MODEL = dict(family="qwen2_5_vl", vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
LAYOUTS = ("d1", "t2", "p2", "d2")
BUDGETS = (None, 48)
GREEDY_TOKENS = 6
IMG, START, END = (TINY_VL_TOKENS[k] for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id"))
CASES = ["case_setup"] + [f"case_{lay}" for lay in LAYOUTS] + ["case_freeze", "case_realloc", "case_qwen2_vl"]


def _png(h: int, w: int, seed: int) -> bytes:
    from PIL import Image

    a = (np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def _samples():
    """(ids, ImageInputs or None) per sequence: text, 1 image, 2 images, text, 1 image."""
    from realflow.api.images import ImageProcessing, expand_image_tokens, process_images

    proc = ImageProcessing(max_pixels=112 * 112)
    g = torch.Generator().manual_seed(0)

    def text(n):
        return torch.randint(3, 140, (n,), generator=g).tolist()

    layouts = [(7, []), (3, [(100, 90)]), (4, [(60, 130), (56, 56)]), (12, []), (2, [(120, 70)]), (3, [(56, 84)])]
    out = []
    for i, (n, sizes) in enumerate(layouts):
        ids = text(n)
        if not sizes:
            out.append((torch.tensor(ids), None))
            continue
        for j, _ in enumerate(sizes):
            ids = ids + [START, IMG, END] + text(2 + j)
        imgs = process_images([_png(h, w, 10 * i + j) for j, (h, w) in enumerate(sizes)], proc)
        ids = expand_image_tokens(ids, imgs.grid_thw, IMG, 2)
        if i == len(layouts) - 1:  # a response that GENERATED <|image_pad|>: a word, not an image slot
            ids = ids + [IMG] + text(2) + [IMG, IMG]
        out.append((torch.tensor(ids), imgs))
    return out


GENERATED_IMAGE_TOKENS = 3  # the last sample's response holds 3 generated <|image_pad|>


def _path(ctx, name="vl"):
    return os.path.join(ctx.tmpdir, name)


def _seq_logprobs(logits, ids):
    lp = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, ids[1:, None])[:, 0]
    return torch.cat([lp, lp.new_zeros(1)])


def _hf_logits(model, ids, imgs):
    if imgs is None:
        return model(input_ids=ids[None]).logits[0]
    prompt_images = (ids == IMG) & (torch.arange(len(ids)) < _last_slot(ids, imgs) + 1)
    if bool(prompt_images.sum() == (ids == IMG).sum()):
        return model(input_ids=ids[None], pixel_values=imgs.pixel_values, image_grid_thw=imgs.grid_thw,
                     mm_token_type_ids=(ids == IMG).int()[None]).logits[0]
    # generated image tokens: transformers' forward would count them as placeholders, so build its
    # inputs as generate() does: features into the prompt's slots only, positions from the
    # processor's token types (prompt image tokens only), the rest embedded as words
    m = model.model
    emb = m.get_input_embeddings()(ids[None])
    feats = torch.cat(m.get_image_features(imgs.pixel_values, imgs.grid_thw).pooler_output)
    emb = emb.masked_scatter(prompt_images[None, :, None], feats.to(emb.dtype))
    pos, _ = m.get_rope_index(ids[None], prompt_images.int()[None], image_grid_thw=imgs.grid_thw)
    return model(inputs_embeds=emb, position_ids=pos).logits[0]


def _last_slot(ids, imgs):
    """Index of the prompt's last image placeholder (the images' token count, in order)."""
    need = int((imgs.grid_thw.prod(-1) // 4).sum())
    return int((ids == IMG).nonzero().flatten()[need - 1])


def _make_references(ctx):
    import copy

    from safetensors.torch import save_file

    _, model = make_tiny_hf(_path(ctx), seed=3, **MODEL)
    ctx.cache["hf"] = model
    samples = _samples()
    ref = {}
    with torch.no_grad():
        ref["logits"] = torch.cat([_hf_logits(model, ids, imgs).float() for ids, imgs in samples])
        for i, (ids, imgs) in enumerate(samples[:-1]):  # (transformers' generate cannot take the last)
            kw = {} if imgs is None else dict(pixel_values=imgs.pixel_values, image_grid_thw=imgs.grid_thw,
                                              mm_token_type_ids=(ids == IMG).int()[None])
            out = model.generate(input_ids=ids[None], max_new_tokens=GREEDY_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, **kw)
            ref[f"greedy{i}"] = out[0, len(ids):].clone()
    for dp in (1, 2):
        m = copy.deepcopy(model).train()
        total_w = sum(len(ids) - 1 for ids, _ in samples)
        nll = sum(-_seq_logprobs(_hf_logits(m, ids, imgs), ids).sum() for ids, imgs in samples)
        (nll / total_w).backward()
        grads = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
        ref[f"dp{dp}_loss"] = (nll.detach() / total_w)[None]
        ref[f"dp{dp}_norm"] = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).float()[None]
        ref.update({f"dp{dp}_grad.{_hf_name(n)}": g for n, g in grads.items()})
    save_file({k: v.contiguous() for k, v in ref.items()}, _path(ctx, "ref.safetensors"))


def _hf_name(module_name: str) -> str:
    """transformers 5 module names -> the checkpoint names (model.visual. -> visual., ...)."""
    for a, b in (("model.visual.", "visual."), ("model.language_model.", "model.")):
        if module_name.startswith(a):
            return b + module_name[len(a):]
    return module_name


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


def _check_reload(ctx, out):
    from transformers import AutoModelForImageTextToText

    orig = ctx.cache["hf"]
    got, info = AutoModelForImageTextToText.from_pretrained(out, output_loading_info=True)
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


def _micro_batch(shard):
    ids = torch.cat([s for s, _ in shard])
    targets = torch.cat([torch.cat([s[1:], s.new_zeros(1)]) for s, _ in shard])
    mask = torch.cat([torch.cat([torch.ones(len(s) - 1), torch.zeros(1)]) for s, _ in shard])
    return (ids, [len(s) for s, _ in shard], {"targets": targets, "mask": mask, "images": [i for _, i in shard]})


def _engine(ctx, layout, **kw):
    from parallel.engine import MegatronEngine
    from parallel.groups import build_model_groups
    from parallel.optim import EngineOptimizerConfig
    from realflow.api.allocation import parse_strategy

    s = parse_strategy(layout)
    groups = build_model_groups(list(range(s.world_size)), s)
    if not groups.is_member:
        return None, s, groups
    opt = EngineOptimizerConfig(lr=1e-3, weight_decay=0.0, warmup_steps_proportion=0.0,
                                lr_scheduler_type="constant", gradient_clipping=100.0, total_train_steps=1)
    return MegatronEngine(_path(ctx), groups, _path(ctx), optimizer_config=opt, seed=1, **kw), s, groups


def _run(ctx, layout):
    from safetensors.torch import load_file

    eng, s, groups = _engine(ctx, layout)
    if eng is None:
        return None
    samples = _samples()
    ids = torch.cat([i for i, _ in samples])
    lens = [len(i) for i, _ in samples]
    images = [im for _, im in samples]
    ref = load_file(_path(ctx, "ref.safetensors"))
    res = {}
    for budget in BUDGETS:
        out = eng.forward(ids, lens, max_tokens_per_mb=budget, images=images)
        if out is not None:
            res[f"logits_err_mb{budget}"] = err = (out - ref["logits"]).abs().max().item()
            assert err <= LOGIT_ATOL, f"{layout} budget={budget}: logits differ by {err}"
    greedy = eng.greedy_generate([i.tolist() for i in ids.split(lens)][:-1], GREEDY_TOKENS, images=images[:-1])
    for i, got in enumerate(greedy):
        assert got == ref[f"greedy{i}"].tolist(), (layout, i, got, ref[f"greedy{i}"].tolist())
    out_dir = _path(ctx, f"saved_{layout}")
    eng.save_hf(out_dir)
    if ctx.rank == 0:
        _check_reload(ctx, out_dir)
    shard = samples[groups.dp_rank::s.dp]
    stats = eng.train_batch([_micro_batch(shard)], nll_loss, nll_weight)
    p = f"dp{s.dp}_"
    res.update(loss=stats["loss"], grad_norm=stats["grad_norm"])
    assert abs(stats["loss"] - float(ref[p + "loss"])) <= 1e-5 * abs(float(ref[p + "loss"])), (stats, ref[p + "loss"])
    assert abs(stats["grad_norm"] - float(ref[p + "norm"])) <= 1e-5 * float(ref[p + "norm"]), (stats, ref[p + "norm"])
    if s.dp == 1:
        grads = eng.full_hf_grads()
        if grads is not None:
            want = {n[len(p + "grad."):]: g for n, g in ref.items() if n.startswith(p + "grad.")}
            assert sorted(grads) == sorted(want), set(grads) ^ set(want)
            scale = max(g.abs().max().item() for g in want.values())
            res["grad_rel"] = max((grads[n] - g).abs().max().item() for n, g in want.items()) / scale
            res["visual_grad_rel"] = max((grads[n] - g).abs().max().item()
                                         for n, g in want.items() if n.startswith("visual.")) / scale
            assert res["grad_rel"] <= GRAD_RTOL, res
    return res


for _lay in LAYOUTS:
    globals()[f"case_{_lay}"] = (lambda lay: lambda ctx: _run(ctx, lay))(_lay)


def case_freeze(ctx):
    """``freeze_vision``: a step changes the language model, not the tower."""
    eng, s, groups = _engine(ctx, "t2", freeze_vision=True)
    tower = {n: p.detach().clone() for n, p in eng.module.visual.named_parameters()}
    head = eng.module.decoder.final_layernorm.weight.detach().clone()
    eng.train_batch([_micro_batch(_samples())], nll_loss, nll_weight)
    assert all(torch.equal(p, tower[n]) for n, p in eng.module.visual.named_parameters())
    assert not torch.equal(head, eng.module.decoder.final_layernorm.weight)
    return {"frozen": len(tower)}


REALLOC_CHAIN = ["d2", "t2", "p2", "d2"]


def case_realloc(ctx):
    """Reallocation through d2 -> t2 -> p2 -> d2: each destination (tower included) equals its
    shard of the checkpoint's full tensors."""
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
    full = {e.mcore_name: hf_to_mcore(e, [hf[n] for n in e.hf_names], arch.vocab_size, 2)
            for e in param_table(cfg, arch)}
    models, checked = [], 0
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
        for full_name, sh in spec.items():
            want = reference_shard(sh, full[full_name])
            assert torch.equal(params[sh.local_name].detach(), want), (name, full_name)
            checked += full_name.startswith("visual.")
        models.append((model, lay))
    assert checked > 0, "no vision tower parameter was checked"
    return {"visual_checked": checked}


@pytest.fixture(scope="module")
def results():
    return run_cases([f"tests.{MODULE}:{c}" for c in CASES], WORLD, timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_vl(results, case):
    r = results[case]
    assert r.ok, r.error


def case_qwen2_vl(ctx):
    """Qwen2-VL (the previous generation: a tower without windows, the same M-RoPE) in t2: logits
    with images equal transformers' ``Qwen2VLForConditionalGeneration``'s."""
    from parallel.engine import MegatronEngine
    from parallel.groups import build_model_groups
    from realflow.api.allocation import parse_strategy

    path = _path(ctx, "qwen2vl")
    samples = _samples()
    err = None
    if ctx.rank == 0:
        try:
            _, model = make_tiny_hf(path, seed=5, **dict(MODEL, family="qwen2_vl"))
            with torch.no_grad():
                ref = torch.cat([_hf_logits(model, ids, imgs).float() for ids, imgs in samples])
            torch.save(ref, path + ".ref.pt")
        except Exception as e:  # noqa: BLE001 - raised after the barrier
            err = e
    dist.barrier()
    if err is not None:
        raise err
    s = parse_strategy("t2")
    eng = MegatronEngine(path, build_model_groups([0, 1], s), path, seed=1)
    out = eng.forward(torch.cat([i for i, _ in samples]), [len(i) for i, _ in samples],
                      images=[im for _, im in samples])
    if out is None:
        return None
    err = (out - torch.load(path + ".ref.pt")).abs().max().item()
    assert err <= LOGIT_ATOL, f"qwen2_vl t2: logits differ by {err}"
    return {"logits_err": err}
