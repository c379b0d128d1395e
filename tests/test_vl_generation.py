"""The built-in engine on a vision-language model (tiny random Qwen2.5-VL, fp32) against transformers.

Proves: greedy output with one image, with two images, and for a batch mixing a text-only
prompt with image prompts (continuous batching: rows join mid-run) equals
``Qwen2_5_VLForConditionalGeneration.generate(do_sample=False)`` given the processor's
``pixel_values`` / ``image_grid_thw`` and expanded placeholders; a retraction (re-prefill of
prompt + output) changes nothing; weight updates reach the tower (HF tensors, staged, disk);
bad image requests raise ValueError naming the mismatch; a text model refuses images; tp = 2
(2-process gloo) equals tp = 1.
"""
from __future__ import annotations

import io
import os

import pytest
import torch

from parallel.testing import run_cases
from realflow.api.generation import SamplingParams
from realflow.api.images import ImageInputs, expand_image_tokens, process_images

torch.set_num_threads(1)
MODULE = __name__.rsplit(".", 1)[-1]
IMAGE, VSTART, VEND = 290, 291, 292
MERGE = 2
LOGPROB_ATOL = 1e-4  # |engine logprob - transformers full-forward logprob|, fp32 (as test_generation_engine)


def tiny_vl_config():
    import transformers

    return transformers.Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=300, bos_token_id=1, eos_token_id=2,
                         max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                           fullatt_block_indexes=[1], window_size=56),
        image_token_id=IMAGE, vision_start_token_id=VSTART, vision_end_token_id=VEND, bos_token_id=1, eos_token_id=2)


def make_tiny_vl(path: str, seed: int = 0):
    """Save a seeded tiny Qwen2.5-VL to ``path``; returns the transformers model (eval, fp32)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(tiny_vl_config()).eval()
    model.save_pretrained(path)
    return model


def png(w: int, h: int, seed: int) -> bytes:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    arr = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def image_prompt(text_before: list[int], n_images: int, text_after: list[int],
                 sizes=((56, 56), (112, 84))) -> list[int]:
    """Prompt ids with one compact placeholder per image (``<vs><pad><ve>``)."""
    ids = list(text_before)
    for _ in range(n_images):
        ids += [VSTART, IMAGE, VEND]
    return ids + list(text_after)


def build(text_before, sources, text_after) -> tuple[list[int], ImageInputs]:
    images = process_images(sources)
    ids = expand_image_tokens(image_prompt(text_before, len(sources), text_after), images.grid_thw, IMAGE, MERGE)
    return ids, images


def greedy(n: int = 10) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


@torch.no_grad()
def hf_greedy(model, ids: list[int], images: ImageInputs | None, n: int) -> list[int]:
    # transformers 5 computes M-RoPE positions only when told which tokens are images (mm_token_type_ids,
    # which its processor returns); without them it would use 1D positions
    kw = {} if images is None else {"pixel_values": images.pixel_values, "image_grid_thw": images.grid_thw,
                                    "mm_token_type_ids": (torch.tensor([ids]) == IMAGE).int()}
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()


def engine(path: str, **kw):
    from parallel.generation import EngineConfig, GenerationEngine

    return GenerationEngine.from_hf(path, EngineConfig(max_model_len=256, **kw), tokenizer=None)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("vl"))
    model = make_tiny_vl(path, seed=0)
    one = build([1, 5, 6], [png(56, 56, 1)], [7, 8, 9])
    two = build([1, 10], [png(112, 84, 2), png(56, 84, 3)], [11, 12])
    return path, model, one, two


@torch.no_grad()
def hf_logprobs(model, ids: list[int], images: ImageInputs, output: list[int]) -> torch.Tensor:
    full = torch.tensor([ids + output])
    logits = model(full, pixel_values=images.pixel_values, image_grid_thw=images.grid_thw,
                   mm_token_type_ids=(full == IMAGE).int()).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(ids) - 1:-1]
    return lp.gather(1, torch.tensor(output)[:, None]).squeeze(1)


def test_one_and_two_images_equal_transformers(vl):
    path, model, one, two = vl
    eng = engine(path)
    for ids, images in (one, two):
        res = eng.generate([ids], greedy(12), images=[images])[0]
        assert res.output_ids == hf_greedy(model, ids, images, 12)
        diff = (hf_logprobs(model, ids, images, res.output_ids) - torch.tensor(res.output_logprobs)).abs().max()
        assert diff <= LOGPROB_ATOL, f"logprob mismatch {diff:.2e}"


def test_mixed_batch_with_joins_equals_transformers(vl):
    """Text and image rows in one running batch; requests join while others decode."""
    path, model, one, two = vl
    text = [1, 20, 21, 22, 23]
    eng = engine(path, max_prefill_tokens=1)  # one joiner per step: later rows join mid-decode
    rids = {}
    for name, (ids, images) in {"text": (text, None), "one": one, "two": two}.items():
        rids[eng.add_request(name, ids, greedy(10), images=images)[0]] = (ids, images)
        eng.step()
    out = {}
    while eng.has_work():
        for r in eng.step():
            out[r.rid] = r.output_ids
    assert set(out) == set(rids)
    for rid, (ids, images) in rids.items():
        assert out[rid] == hf_greedy(model, ids, images, 10), rid


def test_retract_and_reprefill_change_nothing(vl):
    path, model, one, _ = vl
    ids, images = one
    eng = engine(path)
    eng.add_request("a", ids, greedy(10), images=images)
    for _ in range(4):
        eng.step()
    eng.flush_cache()  # re-prefill of prompt + the 3-4 tokens so far, M-RoPE continued over them
    done = []
    while eng.has_work():
        done += eng.step()
    assert done[0].output_ids == hf_greedy(model, ids, images, 10)


def test_weight_updates_reach_the_tower(vl, tmp_path):
    from parallel.hf_io import read_hf_tensors

    path, model, one, _ = vl
    ids, images = one
    other = make_tiny_vl(str(tmp_path / "b"), seed=7)
    want = hf_greedy(other, ids, images, 10)
    assert want != hf_greedy(model, ids, images, 10)
    hf = read_hf_tensors(str(tmp_path / "b"))
    assert any(k.startswith("visual.") for k in hf)
    eng = engine(path)
    assert [n for g in eng.hf_weight_groups() for n in g if n.startswith("visual.")]
    d0 = eng.weights_digest()
    eng.update_weights_from_tensors(hf, "hf", version=3)
    assert eng.generate([ids], greedy(10), images=[images])[0].output_ids == want
    # only the tower's tensors: the language model stays, the features change
    eng2 = engine(path)
    eng2.update_weights_from_tensors({k: v for k, v in hf.items() if k.startswith("visual.")}, "hf")
    assert eng2.weights_digest() not in (d0, eng.weights_digest())
    eng3 = engine(path)
    eng3.stage_weights_from_tensors(hf, "hf", version=5)
    assert eng3.generate([ids], greedy(10), images=[images])[0].output_ids == hf_greedy(model, ids, images, 10)
    eng3.commit_staged_weights(5)
    assert eng3.generate([ids], greedy(10), images=[images])[0].output_ids == want
    assert eng3.weights_digest() == eng.weights_digest()
    eng4 = engine(path)
    eng4.update_weights_from_disk(str(tmp_path / "b"))
    assert eng4.weights_digest() == eng.weights_digest()
    with pytest.raises(ValueError, match="visual.nope"):
        eng4.update_weights_from_tensors({"visual.nope": torch.zeros(1)}, "hf")


@pytest.mark.parametrize("case, match", [
    ("no_images", "no images were given"),
    ("compact", "need 4"),
    ("two_for_one", r"2 image\(s\) need 18 \(12\+6\)"),
])
def test_bad_image_requests(vl, case, match):
    path, _, one, two = vl
    ids, images = one
    eng = engine(path)
    if case == "no_images":
        args = (ids, None)
    elif case == "compact":
        args = (image_prompt([1], 1, [2]), images)
    else:
        args = (ids, two[1])
    with pytest.raises(ValueError, match=match):
        eng.add_request("x", args[0], greedy(), images=args[1])
    assert eng.num_waiting == 0
    assert eng.generate([ids], greedy(4), images=[images])[0].output_ids  # still works


def test_text_model_refuses_images(tmp_path):
    from parallel.testing import make_tiny_hf

    make_tiny_hf(str(tmp_path), family="qwen2")
    eng = engine(str(tmp_path))
    with pytest.raises(ValueError, match="text-only"):
        eng.add_request("x", [1, 2, 3], greedy(), images=process_images([png(56, 56, 1)]))
    assert eng._delta is None and eng.vision is None


# --------------------------------------------------------------------------- tp = 2


def test_tp2_equals_tp1():
    res = run_cases([f"{MODULE}:case_tp2"], world_size=2, timeout=300,
                    pythonpath=[os.path.dirname(os.path.abspath(__file__))])
    assert res["case_tp2"].ok, res["case_tp2"].error
    assert res["case_tp2"].data[0] == res["case_tp2"].data[1]


def case_tp2(ctx):
    """Each rank: a tp=2 engine (tower replicated) == the tp=1 engine == transformers."""
    import torch.distributed as dist

    from parallel.generation import EngineConfig, GenerationEngine

    own = os.path.join(ctx.tmpdir, f"r{ctx.rank}")
    model = make_tiny_vl(own, seed=0)
    dist.barrier()
    path = os.path.join(ctx.tmpdir, "r0")
    tp2 = GenerationEngine.from_hf(path, EngineConfig(max_model_len=256), tp_group=dist.group.WORLD, tokenizer=None)
    assert tp2.spec.tp_size == 2
    one = build([1, 5, 6], [png(56, 56, 1)], [7, 8, 9])
    two = build([1, 10], [png(112, 84, 2), png(56, 84, 3)], [11, 12])
    text = ([1, 20, 21, 22], None)
    prompts = [one, text, two]
    out = tp2.generate([p for p, _ in prompts], greedy(8), images=[im for _, im in prompts])
    for r, (ids, images) in zip(out, prompts):
        assert r.output_ids == hf_greedy(model, ids, images, 8)
    return [r.output_ids for r in out]
