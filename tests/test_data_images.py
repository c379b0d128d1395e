"""Images in data rows: every source form gives HF's pixels, placeholders and content parts render
the tokenizer's own ids, bad images are one line naming file:line and field, the task is seeded."""
import base64
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image, ImageDraw
from transformers import AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from realflow.api.experiment import DatasetSpec
from realflow.api.images import IMAGE_GRID, IMAGE_PIXELS, ImageProcessing, expand_image_tokens
from realflow.api.batch import SequenceBatch
from realflow.data.chat_render import PromptFormat
from realflow.data.dataset import DataRowError, PromptAnswerDataset, SFTDataset, load_rows
from realflow.data.rows import FieldMap
from realflow.data.source import dataset_keys, load_dataset_shard


def _png(w: int, h: int, colour=(200, 40, 40)) -> bytes:
    img = Image.new("RGB", (w, h), (245, 245, 240))
    ImageDraw.Draw(img).ellipse((w // 4, h // 4, w // 2, h // 2), fill=colour)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from experiments.tasks.shapes_count import ensure_tokenizer

    return AutoTokenizer.from_pretrained(ensure_tokenizer(tmp_path_factory.mktemp("vltok") / "tok"))


@pytest.fixture(scope="module")
def pics(tmp_path_factory):
    d = tmp_path_factory.mktemp("pics")
    a, b = _png(84, 84), _png(100, 60, (40, 80, 220))
    (d / "img").mkdir()
    (d / "img" / "a.png").write_bytes(a)
    (d / "b.png").write_bytes(b)
    return d, a, b


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _hf(images: list[bytes], p: ImageProcessing = ImageProcessing()):
    proc = Qwen2VLImageProcessorPil(min_pixels=p.min_pixels, max_pixels=p.max_pixels, patch_size=14,
                                    temporal_patch_size=2, merge_size=2)
    out = proc(images=[Image.open(io.BytesIO(x)).convert("RGB") for x in images], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def test_every_source_form_gives_hfs_pixels(pics, tok, tmp_path):
    d, a, b = pics
    b64 = base64.b64encode(a).decode()
    q = "<image> How many shapes ?"
    rows = [{"prompt": q, "answer": "1", "images": ["img/a.png"]},
            {"prompt": q, "answer": "1", "images": [str(d / "img" / "a.png")]},
            {"prompt": q, "answer": "1", "image": b64},
            {"prompt": q, "answer": "1", "images": ["data:image/png;base64," + b64]},
            {"prompt": q, "answer": "1", "images": [{"bytes": None, "path": "img/a.png"}]},
            {"prompt": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64}},
                {"type": "text", "text": " How many shapes ?"}]}], "answer": "1"}]
    jl = _write(d / "rows.jsonl", rows)
    pt = d / "rows.parquet"
    pq.write_table(pa.table({"prompt": [q, q], "answer": ["1", "1"], "images": [[a], [a]]}), pt)
    pt2 = d / "rows_struct.parquet"
    pq.write_table(pa.table({"prompt": [q], "answer": ["1"], "pics": [[{"bytes": a, "path": "x.png"}]]}), pt2)
    want_px, want_grid = _hf([a])
    samples = (list(PromptAnswerDataset.load(jl, tok, 256)) + list(PromptAnswerDataset.load(pt, tok, 256))
               + list(PromptAnswerDataset.load(pt2, tok, 256, fields=FieldMap(image_key="pics"))))
    assert len(samples) == 9
    for s in samples:
        assert torch.equal(s.images.pixel_values, want_px) and torch.equal(s.images.grid_thw, want_grid)
        assert s.image_bytes == (a,) and s.prompt_ids == samples[0].prompt_ids
        assert "images" not in s.meta and "image" not in s.meta


def test_pixel_budget_comes_from_the_args_and_the_model(pics, tok, tmp_path):
    d, a, b = pics
    p = ImageProcessing(min_pixels=28 * 28, max_pixels=56 * 56)
    rows = load_rows(_write(tmp_path / "r.jsonl", [{"prompt": "<image>", "answer": "1", "images": [str(d / "b.png")]}]))
    ds = PromptAnswerDataset.from_rows(rows, tok, 256, images=p)
    want_px, want_grid = _hf([b], p)
    assert torch.equal(ds[0].images.pixel_values, want_px) and torch.equal(ds[0].images.grid_thw, want_grid)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 100, "max_pixels": 5000,
                                                                   "patch_size": 14, "merge_size": 2}))
    got = ImageProcessing.from_pretrained_dir(str(tmp_path), max_pixels=4000)
    assert (got.min_pixels, got.max_pixels) == (100, 4000)


def _expected(tok, messages, images, template=True):
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    grid = torch.cat([_hf([x])[1] for x in images])
    if template:
        ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False)["input_ids"]
    else:
        ids = tok(messages, add_special_tokens=True)["input_ids"]
    return expand_image_tokens(ids, grid, pad, 2)


def test_placeholders_and_content_parts_render_the_templates_ids(pics, tok, tmp_path):
    d, a, b = pics
    parts = [{"type": "image"}, {"type": "text", "text": "How many shapes ?"}]
    p = _write(tmp_path / "r.jsonl", [
        {"prompt": "<image> How many shapes ?", "answer": "1", "images": [str(d / "img" / "a.png")]},
        {"prompt": "How many shapes ?", "answer": "1", "images": [str(d / "img" / "a.png")]},  # images go first
        {"prompt": [{"role": "user", "content": parts}], "answer": "1", "images": [str(d / "img" / "a.png")]},
        {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "#### 1"}],
         "images": [str(d / "img" / "a.png")]},
        {"prompt": "How many <image> shapes <image> ?", "answer": "2",
         "images": [str(d / "b.png"), str(d / "img" / "a.png")]},
    ])
    ds = PromptAnswerDataset.load(p, tok, 256)
    one = _expected(tok, [{"role": "user", "content": parts}], [a])
    assert [s.prompt_ids for s in ds][:4] == [one] * 4
    two = _expected(tok, [{"role": "user", "content": [
        {"type": "text", "text": "How many "}, {"type": "image"}, {"type": "text", "text": " shapes "},
        {"type": "image"}, {"type": "text", "text": " ?"}]}], [b, a])
    assert ds[4].prompt_ids == two and ds[4].images.num_images == 2
    assert ds[4].images.pixel_values.shape[0] == int(ds[4].images.grid_thw.prod(-1).sum())
    plain = PromptAnswerDataset.load(p, tok, 256, prompt_format=PromptFormat(chat_template="none"))
    assert plain[0].prompt_ids == _expected(tok, "<|vision_start|><|image_pad|><|vision_end|> How many shapes ?",
                                            [a], template=False)


def test_sft_with_images_masks_image_tokens_as_prompt(pics, tok, tmp_path):
    d, a, _ = pics
    p = _write(tmp_path / "s.jsonl", [{"prompt": "<image> How many shapes ?", "solution": "#### 1",
                                        "images": [str(d / "img" / "a.png")]}])
    s = SFTDataset.load(p, tok, 256, 256)[0]
    parts = [{"type": "image"}, {"type": "text", "text": " How many shapes ?"}]
    full = tok(tok.apply_chat_template([{"role": "user", "content": parts}, {"role": "assistant", "content": "#### 1"}],
                                       tokenize=False), add_special_tokens=False)["input_ids"]
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert s.input_ids == expand_image_tokens(full, s.images.grid_thw, pad, 2)
    answer = tok.convert_tokens_to_ids(["####", "1", "<|im_end|>"])
    assert s.input_ids[-3:] == answer and s.prompt_mask[-3:] == [0, 0, 0]
    assert all(m == 1 for t, m in zip(s.input_ids, s.prompt_mask) if t == pad) and s.image_bytes == (a,)


def _bad(tmp_path, pics):
    d, a, _ = pics
    huge = tmp_path / "huge.png"
    Image.new("1", (10000, 10000)).save(huge, optimize=True)
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\nnot an image")
    ok = {"prompt": "<image> How many?", "answer": "1", "images": [str(d / "img" / "a.png")]}
    return ok, [
        ({"images": ["nope.png"]}, f"field 'images'[0]: image file {tmp_path}/nope.png does not exist"),
        ({"images": ["corrupt.png"]}, "field 'images'[0]: not a readable image"),
        ({"images": [str(huge)]}, "field 'images'[0]: image of 10000x10000 pixels is larger than the limit"),
        ({"image": "data:image/png;base64,iVBOR!!"}, "the row has both fields 'images' and 'image'"),
        ({"images": ["data:image/png;base64,iVBOR!!"]}, "field 'images'[0]: not valid base64 image data"),
        ({"images": ["https://x.org/a.png"]}, "field 'images'[0]: remote image"),
        ({"images": [5]}, "field 'images'[0]: an image must be a path"),
        ({"images": [str(d / "img" / "a.png")] * 2}, "1 image placeholder(s)"),
        ({"images": [str(d / "img" / "a.png")] * 2, "prompt": "<image> <image> <image>"}, "fewer images than"),
        ({"images": [], "prompt": [{"role": "user", "content": [{"type": "image"}]}]}, "fewer images than"),
    ]


def test_bad_images_are_one_line_naming_file_line_and_field(tmp_path, pics):
    ok, cases = _bad(tmp_path, pics)
    for row, needle in cases:
        p = _write(tmp_path / "bad.jsonl", [ok, dict(ok, **row)])
        with pytest.raises(DataRowError, match=".") as e:
            load_rows(p)
        msg = str(e.value)
        assert msg.startswith(f"{p}:2: ") and needle in msg and "\n" not in msg, (row, msg)
    p = _write(tmp_path / "big.jsonl", [ok])
    with pytest.raises(DataRowError, match=r"big.jsonl:1: field 'images'\[0\]: image file .* more than the limit"):
        load_rows(p, images=ImageProcessing(max_image_bytes=50))
    pt = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["q", "q"], "answer": ["1", "1"],
                             "images": [[{"bytes": pics[1], "path": None}], [{"bytes": b"junk", "path": None}]]}), pt)
    with pytest.raises(DataRowError, match=r"bad.parquet: row 2: field 'images'\[0\]: not a readable image"):
        load_rows(pt)


def test_images_need_a_vision_model_and_tokenizer(tmp_path, pics):
    from experiments.tasks.tokenizer import build_tokenizer
    from transformers import PreTrainedTokenizerFast
    from realflow.system.preflight import PreflightError, check_images_model

    ok, _ = _bad(tmp_path, pics)
    p = _write(tmp_path / "r.jsonl", [{"prompt": "1+1=", "answer": "2"}, ok])
    spec = DatasetSpec(format="prompt_answer", path=str(p))
    with pytest.raises(PreflightError) as e:
        check_images_model(spec, {"model_type": "qwen2"}, "training data")
    assert str(e.value) == (f"training data: {p}:2: field 'images': row has images but model_type=qwen2 is "
                            "text-only: use a vision-language model such as Qwen2.5-VL or drop the images")
    check_images_model(spec, {"model_type": "qwen2_5_vl", "vision_config": {}}, "training data")
    check_images_model(DatasetSpec(format="prompt_answer", path=str(_write(tmp_path / "t.jsonl", [
        {"prompt": "1+1=", "answer": "2"}]))), {"model_type": "qwen2"}, "training data")
    text_tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(["1+1=2"], 100), eos_token="</s>")
    with pytest.raises(ValueError, match="lacks the vision tokens <\\|image_pad\\|>"):
        PromptAnswerDataset.load(p, text_tok, 256, prompt_format=PromptFormat(chat_template="none"))


def test_batches_carry_the_image_keys(pics, tok, tmp_path):
    d, a, _ = pics
    img = str(d / "img" / "a.png")
    p = _write(tmp_path / "r.jsonl", [{"prompt": "<image> How many shapes ?", "answer": "1", "images": [img]},
                                      {"prompt": "How many shapes ?", "answer": "0"}])
    spec = DatasetSpec(format="prompt_answer", path=str(p), args={"max_prompt_len": 256})
    batch = SequenceBatch.gather(load_dataset_shard(spec, tok, 0, 1))
    assert batch.seqlens[IMAGE_PIXELS] == [[36], [0]] and batch.seqlens[IMAGE_GRID] == [[1], [0]]
    assert batch.data[IMAGE_PIXELS].shape == (36, 1176) and batch.data[IMAGE_GRID].tolist() == [[1, 6, 6]]
    assert batch.seqlens["packed_prompts"] == [[20], [9]]  # 9 image tokens (a 6x6 grid, merged 2x2)
    assert IMAGE_PIXELS not in dataset_keys(spec)
    vl = DatasetSpec(format="sft", path=str(_write(tmp_path / "t.jsonl", [{"prompt": "How", "solution": "#### 1"}])),
                     args={"max_prompt_len": 64, "max_seq_len": 64, "image_inputs": True})
    assert {IMAGE_PIXELS, IMAGE_GRID} <= set(dataset_keys(vl))
    (s,) = load_dataset_shard(vl, tok, 0, 1)
    assert s.seqlens[IMAGE_PIXELS] == [[0]] and s.data[IMAGE_PIXELS].shape == (0, 1176)
    text = DatasetSpec(format="sft", path=vl.path, args={"max_prompt_len": 64, "max_seq_len": 64})
    assert IMAGE_PIXELS not in load_dataset_shard(text, tok, 0, 1)[0].data


def test_rollout_batches_carry_the_prompts_images(pics, tok, tmp_path):
    from realflow.api.images import ImageInputs
    from realflow.api.rollout import Trajectory, rollout_to_batch

    d, a, _ = pics
    p = _write(tmp_path / "r.jsonl", [{"prompt": "<image> How many shapes ?", "answer": "1",
                                        "images": [str(d / "img" / "a.png")]}])
    s = PromptAnswerDataset.load(p, tok, 256)[0]
    trajs = [Trajectory.single_turn(s.prompt_ids, [19, 2], [-0.1, -0.2], [0, 0], 1.0) for _ in range(3)]
    b = rollout_to_batch("r-1/e0", trajs, 0, answer="1", images=s.images)
    assert b.seqlens[IMAGE_PIXELS] == [[36]] and b.seqlens[IMAGE_GRID] == [[1]] and len(b.seqlens["packed_input_ids"][0]) == 3
    e = rollout_to_batch("r-2/e0", trajs, 0, images=ImageInputs.empty())
    assert e.seqlens[IMAGE_PIXELS] == [[0]]
    assert IMAGE_PIXELS not in rollout_to_batch("r-3/e0", trajs, 0).data
