"""Data set formats, bad rows (file:line: reason), length filters, sharding and shuffling."""
import json

import pytest
from transformers import AutoTokenizer

from experiments.tasks.arithmetic import ensure_dataset
from experiments.tasks.tokenizer import ensure_tokenizer
from realflow.api.dataset import (DATASET_FORMATS, DataRowError, PromptAnswerDataset, SFTDataset,
                                  extract_final_answer, load_rows)
from realflow.api.registry import RegistryError


@pytest.fixture(scope="module")
def arith(tmp_path_factory):
    return ensure_dataset(tmp_path_factory.mktemp("arith"), 1000, 101, seed=0, difficulty=3,
                          style="reverse")


@pytest.fixture(scope="module")
def tok(tmp_path_factory, arith):
    return AutoTokenizer.from_pretrained(ensure_tokenizer(tmp_path_factory.mktemp("t") / "tok", [arith.train]))


def _write(path, lines):
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def test_prompt_answer_reads_plain_gsm8k_boxed_and_numeric_answers(tmp_path):
    p = _write(tmp_path / "pa.jsonl", [
        {"id": "a", "prompt": "1+1=", "answer": "2"},
        {"question": "How many?", "answer": "She has 3 + 4 = 7 apples.\n#### 7"},
        "",  # blank lines are skipped but still counted
        {"problem": "x?", "solution": "so $x = \\boxed{\\frac{1}{2}}$."},
        {"prompt": "n?", "answer": 12, "level": 3},
    ])
    rows = load_rows(p, "prompt_answer")
    assert [r.answer for r in rows] == ["2", "7", "\\frac{1}{2}", "12"]
    assert [r.id for r in rows] == ["a", "pa-2", "pa-4", "pa-5"]
    assert rows[3].meta == {"level": 3}


def test_sft_reads_prompt_and_solution(tmp_path):
    p = _write(tmp_path / "s.jsonl", [{"prompt": "1+2=", "solution": "3 #### 3", "id": 7},
                                      {"prompt": "q", "response": "free text"}])
    rows = load_rows(p, "sft")
    assert (rows[0].id, rows[0].response, rows[0].answer) == ("7", "3 #### 3", "3")
    assert rows[1].answer is None


BAD_ROWS = [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "row must be a JSON object, got list"),
    ({"answer": "1"}, "missing field 'prompt' or 'question' or 'problem'"),
    ({"prompt": "   ", "answer": "1"}, "field 'prompt' is empty"),
    ({"prompt": 5, "answer": "1"}, "field 'prompt' must be a string, got int"),
    ({"prompt": "q"}, "missing field 'answer'"),
    ({"prompt": "q", "answer": ["1"]}, "field 'answer' must be a string or number, got list"),
    ({"prompt": "q", "answer": ""}, "field 'answer' is empty"),
    ({"prompt": "q", "solution": "no final line"}, "no final answer in field 'solution'"),
    ({"prompt": "q", "answer": "1", "id": 1.5}, "field 'id' must be a non-empty string or integer"),
    ({"prompt": "q", "answer": "1", "id": "a"}, "duplicate id 'a' (first at line 1)"),
]


@pytest.mark.parametrize("bad,reason", BAD_ROWS)
def test_bad_row_names_file_and_line(tmp_path, bad, reason):
    p = _write(tmp_path / "d.jsonl", [{"id": "a", "prompt": "ok", "answer": "1"}, "", bad])
    with pytest.raises(DataRowError) as e:
        load_rows(p, "prompt_answer")
    msg = str(e.value)
    assert msg.startswith(f"{p}:3: ") and reason in msg and "\n" not in msg
    assert (e.value.path, e.value.line) == (str(p), 3)


def test_bad_sft_rows_and_files(tmp_path):
    p = _write(tmp_path / "s.jsonl", [{"prompt": "q", "answer": "1"}])
    with pytest.raises(DataRowError, match=r"s\.jsonl:1: missing field 'response' or 'solution'"):
        load_rows(p, "sft")
    with pytest.raises(DataRowError, match="no such data file"):
        load_rows(tmp_path / "missing.jsonl")
    with pytest.raises(DataRowError, match="no rows"):
        load_rows(_write(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(RegistryError, match="unknown data set format 'prompt_answr'.*did you mean 'prompt_answer'"):
        load_rows(p, "prompt_answr")


def test_user_format_registers_and_its_errors_get_a_line(tmp_path):
    from realflow.api.dataset import PromptAnswerRow

    def parse_qa(raw):
        if "q" not in raw:
            raise ValueError("needs 'q'")
        return PromptAnswerRow(id="", prompt=raw["q"], answer=str(raw["a"]))

    DATASET_FORMATS.register("test_qa", parse_qa)
    try:
        p = _write(tmp_path / "qa.jsonl", [{"q": "1+1", "a": 2}, {"x": 1}])
        with pytest.raises(DataRowError, match=r"qa\.jsonl:2: needs 'q'"):
            load_rows(p, "test_qa")
        assert load_rows(_write(tmp_path / "ok.jsonl", [{"q": "1+1", "a": 2}]), "test_qa")[0].answer == "2"
        with pytest.raises(DataRowError, match=r"no_a\.jsonl:1: missing field 'a'$"):
            load_rows(_write(tmp_path / "no_a.jsonl", [{"q": "1+1"}]), "test_qa")  # KeyError in user code
    finally:
        DATASET_FORMATS.unregister("test_qa")


def test_extract_final_answer():
    assert extract_final_answer("a \\boxed{1} then \\boxed{\\frac{2}{3}}") == ("\\frac{2}{3}", "boxed")
    assert extract_final_answer("steps\n#### 1,234\n") == ("1,234", "####")
    assert extract_final_answer("\\boxed{unclosed") == (None, "none")
    assert extract_final_answer("####   ") == (None, "none")


def test_sft_dataset_masks_prompt_and_appends_eos(arith, tok):
    ds = SFTDataset.load(arith.train, tok, max_prompt_len=64)
    s = ds[0]
    row = json.loads(open(arith.train).readline())
    p = tok(row["prompt"])["input_ids"]
    assert s.input_ids[:len(p)] == p and s.prompt_len == len(p)
    assert s.input_ids[-1] == tok.eos_token_id
    assert s.prompt_mask == [1] * len(p) + [0] * (len(s.input_ids) - len(p))
    assert tok.decode(s.input_ids[len(p):], skip_special_tokens=True) == row["solution"]
    assert s.answer == row["answer"] and s.meta["op"] == row["op"]
    assert (ds.report.total, ds.report.kept, ds.report.dropped) == (1000, 1000, {})


def test_length_filters_report_dropped_counts(arith, tok):
    rows = load_rows(arith.train, "sft")
    plens = [len(tok(r.prompt)["input_ids"]) for r in rows]
    slens = [p + len(tok(r.response, add_special_tokens=False)["input_ids"]) + 1 for p, r in zip(plens, rows)]
    ds = SFTDataset.from_rows(rows, tok, max_prompt_len=7, max_seq_len=14)
    too_long_prompt = sum(p > 7 for p in plens)
    too_long_seq = sum(p <= 7 and s > 14 for p, s in zip(plens, slens))
    assert too_long_prompt > 0 and too_long_seq > 0
    assert ds.report.dropped == {"prompt_too_long": too_long_prompt, "sequence_too_long": too_long_seq}
    assert len(ds) == ds.report.kept == 1000 - too_long_prompt - too_long_seq
    assert all(s.prompt_len <= 7 and len(s.input_ids) <= 14 for s in ds)
    assert f"kept {len(ds)}/1000 rows" in str(ds.report)

    pa = PromptAnswerDataset.load(arith.test, tok, max_prompt_len=7)
    test_plens = [len(tok(json.loads(line)["prompt"])["input_ids"]) for line in open(arith.test)]
    assert pa.report.dropped.get("prompt_too_long", 0) == sum(p > 7 for p in test_plens) > 0
    assert all(len(s.prompt_ids) <= 7 for s in pa)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_shards_cover_every_sample_exactly_once(arith, tok, world):
    ds = PromptAnswerDataset.load(arith.test, tok, max_prompt_len=64)  # 101 samples: uneven
    shards = [ds.shard(r, world) for r in range(world)]
    ids = [i for s in shards for i in s.ids]
    assert sorted(ids) == sorted(ds.ids) and len(ids) == len(ds)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert [s.ids for s in shards] == [ds.shard(r, world).ids for r in range(world)]  # deterministic
    even = [ds.shard(r, world, even=True) for r in range(world)]
    assert len({len(s) for s in even}) == 1 and sum(map(len, even)) == len(ds) - len(ds) % world


def test_shard_rejects_bad_rank(arith, tok):
    ds = PromptAnswerDataset.load(arith.test, tok, max_prompt_len=64)
    for rank, world in [(2, 2), (-1, 2), (0, 0)]:
        with pytest.raises(ValueError, match="rank"):
            ds.shard(rank, world)


def test_epoch_shuffle_is_deterministic_and_batches_resume(arith, tok):
    ds = SFTDataset.load(arith.train, tok, max_prompt_len=64, seed=5)
    again = SFTDataset.load(arith.train, tok, max_prompt_len=64, seed=5)
    assert ds.epoch_order(0) == again.epoch_order(0)
    assert ds.epoch_order(0) != ds.epoch_order(1)
    assert sorted(ds.epoch_order(3)) == list(range(len(ds)))
    assert SFTDataset.load(arith.train, tok, max_prompt_len=64, seed=6).epoch_order(0) != ds.epoch_order(0)

    batches = list(ds.iter_batches(64, epoch=2))
    assert sorted(s.id for b in batches for s in b) == sorted(ds.ids)
    assert [len(b) for b in batches] == [64] * 15 + [40]
    assert [len(b) for b in ds.iter_batches(64, epoch=2, drop_last=True)] == [64] * 15
    resumed = list(ds.iter_batches(64, epoch=2, start=10))
    assert [[s.id for s in b] for b in resumed] == [[s.id for s in b] for b in batches[10:]]
