"""Images over HTTP: the gen server's ``image_data`` and the OpenAI proxy's ``image_url`` parts (tiny Qwen2.5-VL).

Proves: ``/generate`` with ``image_data`` (base64, data URL; one placeholder per image or
expanded placeholders; a batch mixing a text prompt and an image prompt) gives the tokens of
the in-process engine (greedy), which equal transformers' (tests/test_vl_generation.py); bad
image requests answer 400 naming the prompt; a text model answers 400 to images; a chat request
with an ``image_url`` data-URL part through the proxy (a test tokenizer whose chat template
renders image parts as Qwen2.5-VL's does) gives the same tokens and records the expanded prompt.
"""
from __future__ import annotations

import asyncio
import base64
import sys
import os

import pytest
import torch

from realflow.api.generation import SamplingParams
from realflow.rollout.gen_client import GenerationClient, GenerationServerError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_vl_generation import IMAGE, VEND, VSTART, build, engine, greedy, image_prompt, make_tiny_vl, png  # noqa: E402

torch.set_num_threads(1)
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("vl"))
    make_tiny_vl(path, seed=0)
    return path


@pytest.fixture(scope="module")
def server(vl, start_gen_server):
    return start_gen_server(vl, "--max-model-len", "256")


@pytest.fixture
def client(server):
    with GenerationClient(server[0], timeout=30, generate_timeout=120) as c:
        yield c
        assert c.is_healthy()


def test_generate_with_image_data_equals_the_engine(client, vl):
    img1, img2, img3 = png(56, 56, 1), png(112, 84, 2), png(56, 84, 3)
    ids1, im1 = build([1, 5, 6], [img1], [7, 8, 9])
    ids2, im2 = build([1, 10], [img2, img3], [11, 12])
    text = [1, 20, 21, 22]
    eng = engine(vl)
    want = [r.output_ids for r in eng.generate([ids1, text, ids2], greedy(8), images=[im1, None, im2])]
    # one placeholder per image, bytes (sent as base64)
    r = client.generate(image_prompt([1, 5, 6], 1, [7, 8, 9]), {"max_new_tokens": 8, **GREEDY}, image_data=img1)
    assert r["output_ids"] == want[0]
    assert r["meta_info"]["prompt_tokens"] == len(ids1)
    # expanded placeholders, a data URL
    url = "data:image/png;base64," + base64.b64encode(img1).decode()
    r = client.generate(ids1, {"max_new_tokens": 8, **GREEDY}, image_data=[url])
    assert r["output_ids"] == want[0]
    # a batch: text prompt and a two-image prompt in one request
    batch = client.generate([ids1, text, image_prompt([1, 10], 2, [11, 12])], {"max_new_tokens": 8, **GREEDY},
                            image_data=[img1, None, [img2, img3]])
    assert [b["output_ids"] for b in batch] == want


def test_bad_image_requests_are_400(client):
    img = png(56, 56, 1)
    sp = {"max_new_tokens": 2, **GREEDY}
    cases = [
        (dict(input_ids=[1, 2, 3], image_data=[img]), "0 image placeholder"),
        (dict(input_ids=[1, VSTART, IMAGE, IMAGE, VEND], image_data=[img]), "2 image placeholder"),
        (dict(input_ids=[1, VSTART, IMAGE, VEND], image_data="http://example.com/a.png"), "fetches no URL"),
        (dict(input_ids=[1, VSTART, IMAGE, VEND], image_data="data:image/png;base64,aGVsbG8gd29ybGQ="), "not a readable image"),
        (dict(input_ids=[[1, 2], [1, VSTART, IMAGE, VEND]], image_data=[img]), "one entry per prompt"),
        (dict(input_ids=[[1, 2], [1, IMAGE, IMAGE]], image_data=[None, img]), "prompt 1: "),
        (dict(input_ids=[1, VSTART, IMAGE, VEND]), "no images were given"),
    ]
    for kw, match in cases:
        with pytest.raises(GenerationServerError, match=match) as e:
            client.generate(kw["input_ids"], sp, image_data=kw.get("image_data"))
        assert e.value.status == 400


def test_text_model_refuses_image_data(start_gen_server, tmp_path_factory):
    from parallel.testing import make_tiny_hf

    path = str(tmp_path_factory.mktemp("text"))
    make_tiny_hf(path, family="qwen2")
    url, _ = start_gen_server(path, "--max-model-len", "64")
    with GenerationClient(url, timeout=30) as c:
        with pytest.raises(GenerationServerError, match="text-only") as e:
            c.generate([1, 2, 3], {"max_new_tokens": 2}, image_data=png(56, 56, 1))
        assert e.value.status == 400


# --------------------------------------------------------------------------- the OpenAI proxy

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m.role }} "
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %} <|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def vl_tokenizer():
    """A word-level tokenizer over the tiny model's 300 ids whose chat template renders image parts
    as Qwen2.5-VL's does (``<|vision_start|><|image_pad|><|vision_end|>``, ids 291 290 292)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = {0: "<pad>", 1: "<bos>", 2: "<eos>", 3: "<|im_start|>", 4: "<|im_end|>", IMAGE: "<|image_pad|>",
               VSTART: "<|vision_start|>", VEND: "<|vision_end|>"}
    words = {10: "user", 11: "assistant", 12: "system", 13: "describe", 14: "the", 15: "picture", 16: "and",
             17: "this", 18: "one", 19: "<unk>"}
    vocab = {special.get(i) or words.get(i) or f"w{i}": i for i in range(300)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": [special[i] for i in (3, 4, IMAGE, VSTART, VEND)]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _proxy_run(url, body, image_token_id=IMAGE):
    from realflow.api.agent import Completion
    from realflow.api.rollout import RolloutSpec
    from realflow.rollout.controller import RolloutController
    from realflow.rollout.openai_proxy import OpenAIProxy, ProxyConfig

    async def main():
        ctl = RolloutController(RolloutSpec(model_path="m", tokenizer_path="t", dataset_path="d"), [url], None)
        await ctl.start()

        async def generate(ids, params, n, rid, image_data=None):
            outs = await asyncio.gather(*(ctl.pool.complete(f"{rid}-{i}", ids, dict(params), image_data)
                                          for i in range(n)))
            return [Completion(o.prompt_ids, o.output_ids, o.logprobs, o.versions, o.finish_reason) for o in outs]

        proxy = OpenAIProxy(generate, vl_tokenizer(), ProxyConfig(model_name="policy", max_tokens=16,
                                                                  image_token_id=image_token_id))
        await proxy.start()
        try:
            return await body(proxy, proxy.open_session(seed=5))
        finally:
            await proxy.stop()
            await ctl.close()

    return asyncio.run(main())


async def _post(proxy, s, payload):
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.base_url + "/chat/completions", json=payload,
                             headers={"Authorization": f"Bearer {s.key}"},
                             timeout=aiohttp.ClientTimeout(total=120)) as resp:
            return resp.status, await resp.json()


def _data_url(img: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(img).decode()


def test_proxy_image_url_part_equals_the_engine(server, vl):
    img1, img2 = png(56, 56, 1), png(112, 84, 2)
    messages = [{"role": "user", "content": [{"type": "text", "text": "describe"},
                                             {"type": "image_url", "image_url": {"url": _data_url(img1)}},
                                             {"type": "text", "text": "and this one"},
                                             {"type": "image_url", "image_url": {"url": _data_url(img2)}}]}]

    async def body(proxy, s):
        status, out = await _post(proxy, s, {"model": "policy", "messages": messages, "max_tokens": 8,
                                             "temperature": 0})
        return status, out, s.records

    status, out, records = _proxy_run(server[0], body)
    assert status == 200, out
    tok = vl_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "describe"}, {"type": "image"}, {"type": "text", "text": "and this one"},
        {"type": "image"}]}], tokenize=False, add_generation_prompt=True)
    compact = tok.encode(text, add_special_tokens=False)
    assert compact.count(IMAGE) == 2
    from realflow.api.images import expand_image_tokens, process_images

    images = process_images([img1, img2])
    ids = expand_image_tokens(compact, images.grid_thw, IMAGE, 2)
    want = engine(vl).generate([ids], SamplingParams(max_new_tokens=8, temperature=0.0), images=[images])[0]
    (rec,) = records
    assert rec.prompt_ids == ids and rec.output_ids == want.output_ids
    assert torch.equal(rec.images.grid_thw, images.grid_thw)
    assert torch.equal(rec.images.pixel_values, images.pixel_values)


def test_proxy_refuses_urls_and_images_for_a_text_model(server):
    def msg(url):
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]

    async def body(proxy, s):
        return await _post(proxy, s, {"model": "policy", "messages": msg("https://example.com/cat.png")})

    status, out = _proxy_run(server[0], body)
    assert status == 400 and "only data: URLs" in out["error"]["message"], out

    async def text_model(proxy, s):
        return await _post(proxy, s, {"model": "policy", "messages": msg(_data_url(png(56, 56, 1)))})

    status, out = _proxy_run(server[0], text_model, image_token_id=None)
    assert status == 400 and "text-only" in out["error"]["message"], out


# --------------------------------------------------------------------------- pieces


def test_expand_prompt_takes_compact_expanded_and_mixed_runs():
    from realflow.api.images import ImageError, ImageProcessing, process_images
    from realflow.rollout.image_prompts import expand_prompt

    grid = process_images([png(56, 56, 1), png(112, 84, 2)]).grid_thw  # 4 and 12 tokens
    full = [1, VSTART] + [IMAGE] * 4 + [VEND, 5, VSTART] + [IMAGE] * 12 + [VEND]
    assert expand_prompt([1, VSTART, IMAGE, VEND, 5, VSTART, IMAGE, VEND], grid, IMAGE, 2) == full
    assert expand_prompt(full, grid, IMAGE, 2) == full
    assert expand_prompt(full[:8] + [VSTART, IMAGE, VEND], grid, IMAGE, 2) == full  # spliced turn + a new image
    with pytest.raises(ImageError, match=r"3 image placeholder token\(s\) .* 2 run\(s\) for 2 image\(s\) of 4\+12"):
        expand_prompt([IMAGE, IMAGE, 5, IMAGE], grid, IMAGE, 2)
    from realflow.api.generation import GenServerLimits

    d, lim = ImageProcessing(), GenServerLimits()
    assert (lim.min_pixels, lim.max_pixels) == (d.min_pixels, d.max_pixels)


def test_trajectory_images_become_the_samples_image_keys():
    from realflow.api.images import IMAGE_GRID, IMAGE_PIXELS
    from realflow.api.rollout import RolloutError, Trajectory, rollout_to_batch

    ids, images = build([1, 5], [png(56, 56, 1)], [7])
    trajs = [Trajectory.single_turn(ids, [8, 9], [-0.1, -0.2], [0, 0], r, images=images) for r in (0.0, 1.0)]
    batch = rollout_to_batch("s0", trajs, 0)
    assert torch.equal(batch.data[IMAGE_PIXELS], images.pixel_values)
    assert torch.equal(batch.data[IMAGE_GRID], images.grid_thw)
    assert batch.seqlens[IMAGE_GRID] == [[1]] and batch.seqlens[IMAGE_PIXELS] == [[images.pixel_values.shape[0]]]
    trajs[1].images = None
    with pytest.raises(RolloutError, match="1 of 2 trajectories carry images"):
        rollout_to_batch("s0", trajs, 0)
