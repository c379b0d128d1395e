"""The offline task tokenizer: loads with AutoTokenizer, digits are single tokens, text round-trips."""
import json
import os

import pytest
from transformers import AutoTokenizer

from experiments.tasks.arithmetic import ensure_dataset
from experiments.tasks.tokenizer import ensure_tokenizer


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return ensure_dataset(tmp_path_factory.mktemp("arith"), 2000, 100, seed=0, difficulty=3,
                          style="reverse")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, data):
    return ensure_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer", [data.train])


def test_autotokenizer_loads_it_with_special_tokens(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert len(tok) < 200
    assert (tok.pad_token, tok.bos_token, tok.eos_token, tok.unk_token) == ("<pad>", "<s>", "</s>", "<unk>")
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id}) == 4
    assert tok("1+2=")["input_ids"][0] == tok.bos_token_id  # BOS is added to prompts
    assert tok.bos_token_id not in tok("1+2=", add_special_tokens=False)["input_ids"]


def test_digits_are_individual_tokens(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    ids = tok("9081726354", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == list("9081726354")
    # a digit is the same token wherever it appears
    a = tok("#### 7", add_special_tokens=False)["input_ids"][-1]
    b = tok("17+7=", add_special_tokens=False)["input_ids"][1]
    assert a == b == tok.convert_tokens_to_ids("7")


def test_prompts_solutions_and_ascii_text_round_trip(tok_dir, data):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    rows = [json.loads(line) for line in open(data.test)]
    texts = [r["prompt"] for r in rows] + [r["solution"] for r in rows] + [
        "Hello, World! 3.14 \\boxed{-7}\n  #### 42\tend", "a  b   c"]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids, text
        assert tok.decode(ids) == text
    full = tok(rows[0]["prompt"])["input_ids"] + tok(rows[0]["solution"], add_special_tokens=False)["input_ids"]
    assert tok.decode(full + [tok.eos_token_id], skip_special_tokens=True) == rows[0]["prompt"] + rows[0]["solution"]


def test_responses_are_short(tok_dir, data):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    rows = [json.loads(line) for line in open(data.train)][:200]
    lens = [len(tok(r["solution"], add_special_tokens=False)["input_ids"]) for r in rows]
    assert max(lens) <= 12  # "9751 #### 1579": 4 + 1 + 4 digits plus separators


def test_ensure_tokenizer_is_idempotent_and_deterministic(tmp_path, data, tok_dir):
    out = ensure_tokenizer(tmp_path / "t", [data.train])
    mtime = os.stat(os.path.join(out, "tokenizer.json")).st_mtime_ns
    assert ensure_tokenizer(tmp_path / "t", [data.train]) == out
    assert os.stat(os.path.join(out, "tokenizer.json")).st_mtime_ns == mtime
    # the same corpus trains the same tokenizer
    assert json.load(open(os.path.join(out, "tokenizer.json"))) == json.load(
        open(os.path.join(tok_dir, "tokenizer.json")))
    # another corpus: rebuilt
    other = tmp_path / "other.txt"
    other.write_text("zebra zebra zebra quux quux quux\n" * 5)
    ensure_tokenizer(tmp_path / "t", [other])
    vocab = json.load(open(os.path.join(out, "tokenizer.json")))["model"]["vocab"]
    assert any("zebra" in t or "quux" in t or "qu" in t for t in vocab)


def test_bad_corpus_line_is_named(tmp_path):
    from realflow.data.dataset import DataRowError

    bad = tmp_path / "c.jsonl"
    bad.write_text('{"prompt": "1+1="}\n{oops\n')
    with pytest.raises(DataRowError, match=r"c\.jsonl:2: invalid JSON"):
        ensure_tokenizer(tmp_path / "t", [bad])


def test_a_checkpoint_loads_the_tokenizer_it_was_saved_with(tok_dir, tmp_path):
    """Next to a qwen2 config.json, AutoTokenizer (transformers 5) would build a Qwen2Tokenizer,
    whose pre-tokenizer splits some text differently: every stage loads the declared class."""
    import shutil

    from realflow.base.tokenizer_loading import load_tokenizer

    ck = tmp_path / "checkpoint"
    shutil.copytree(tok_dir, ck)
    (ck / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    plain, in_checkpoint = AutoTokenizer.from_pretrained(tok_dir), load_tokenizer(ck)
    assert type(in_checkpoint).__name__ != "Qwen2Tokenizer"
    for text in ["What is 12+7? Answer: 19", "Hello, World! 3.14 \\boxed{-7}\n  #### 42\tend", "a  b   c"]:
        assert in_checkpoint(text)["input_ids"] == plain(text)["input_ids"], text
