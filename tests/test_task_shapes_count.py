"""The generated image task: seeded, its jsonl and parquet copies agree, its answers pass the
``arithmetic`` reward, and a random Qwen2.5-VL checkpoint for its tokenizer runs in transformers."""
import json
import os

import pytest
import torch

from experiments.tasks.shapes_count import ensure_dataset, ensure_tokenizer, generate_split


def _files(root):
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, fs in os.walk(root) for f in fs}


def test_seeded_and_idempotent(tmp_path):
    a = ensure_dataset(tmp_path / "a", 12, 4, seed=3, difficulty=5, colour_rate=0.5)
    ensure_dataset(tmp_path / "b", 12, 4, seed=3, difficulty=5, colour_rate=0.5)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    before = os.stat(a.train).st_mtime_ns
    ensure_dataset(tmp_path / "a", 12, 4, seed=3, difficulty=5, colour_rate=0.5)  # cached: not rewritten
    assert os.stat(a.train).st_mtime_ns == before
    other = generate_split("train", 12, 4, 5)
    assert [r for r, _ in other] != [json.loads(x) for x in open(a.train)]
    rows = [json.loads(x) for x in open(a.train)]
    assert all(1 <= r["count"] <= 5 and r["solution"] == f"#### {r['answer']}" for r in rows)
    assert all(os.path.isfile(os.path.join(a.images, os.path.basename(r["images"][0]))) for r in rows)
    assert any(r["colour"] for r in rows) and any(not r["colour"] for r in rows)
    with pytest.raises(ValueError, match="difficulty"):
        generate_split("train", 2, 0, 10)


def test_answers_pass_the_arithmetic_reward():
    from mfc.math_reward import arithmetic_reward

    for row, _ in generate_split("test", 20, 0, 9, colour_rate=0.5):
        assert arithmetic_reward(row["solution"], row["answer"]).reward == 1.0
        assert arithmetic_reward("#### 11", row["answer"]).reward == 0.0


def test_jsonl_and_parquet_give_the_same_samples_and_a_vl_checkpoint_runs(tmp_path):
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from experiments.init_model import TinyArchConfig, ensure_random_checkpoint, planned_hf_config
    from realflow.data.dataset import PromptAnswerDataset, SFTDataset

    d = ensure_dataset(tmp_path / "data", 6, 2, seed=0, difficulty=4)
    tok_dir = ensure_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    a = PromptAnswerDataset.load(d.train, tok, 64)
    b = PromptAnswerDataset.load(d.train_parquet, tok, 64)
    assert len(a) == len(b) == 6
    for x, y in zip(a, b):
        assert x.prompt_ids == y.prompt_ids and x.answer == y.answer and x.image_bytes == y.image_bytes
        assert torch.equal(x.images.pixel_values, y.images.pixel_values) and x.images.grid_thw.tolist() == [[1, 6, 6]]
    assert len(a[0].prompt_ids) <= 24
    sft = SFTDataset.load(d.train, tok, 64, 64)
    assert tok.decode([t for t, m in zip(sft[0].input_ids, sft[0].prompt_mask) if not m]).startswith("####")

    arch = TinyArchConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=128, vision=True)
    assert planned_hf_config(arch)["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]
    ckpt = ensure_random_checkpoint(str(tmp_path / "ckpt"), tok_dir, arch, seed=0)
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    assert cfg["image_token_id"] == tok.convert_tokens_to_ids("<|image_pad|>")
    assert cfg["text_config"]["eos_token_id"] == tok.eos_token_id
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt).eval()
    s = a[0]
    with torch.no_grad():
        out = model(input_ids=torch.tensor([s.prompt_ids]), pixel_values=s.images.pixel_values,
                    image_grid_thw=s.images.grid_thw)
    assert out.logits.shape == (1, len(s.prompt_ids), len(tok))
    with pytest.raises(ValueError, match="vision"):
        TinyArchConfig(vision=True, num_experts=4)
