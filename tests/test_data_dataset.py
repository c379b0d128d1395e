"""Data set formats, bad rows (file:line: reason), length filters, sharding and shuffling."""
import json
import logging

import pytest
from transformers import AutoTokenizer

from experiments.tasks.arithmetic import ensure_dataset
from experiments.tasks.tokenizer import ensure_tokenizer
from realflow.data.source import dataset_keys, load_dataset_shard
from realflow.data.dataset import (DATASET_FORMATS, DataRowError, PromptAnswerDataset, PromptFormat, SFTDataset,
                                  extract_final_answer, load_rows, load_rows_report)
from realflow.api.experiment import DatasetSpec
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
    from realflow.data.dataset import PromptAnswerRow

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


# ----------------------------------------------------------------------------- math RL formats


def test_gsm8k_format_reads_final_answer_and_keeps_solution(tmp_path):
    p = _write(tmp_path / "gsm.jsonl", [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "Big?", "answer": "so 1,234 in total\n#### 1,234", "id": 9},
    ])
    rows = load_rows(p, "gsm8k")
    assert [(r.id, r.prompt[:3], r.answer) for r in rows] == [("gsm-1", "Tom", "7"), ("9", "Big", "1,234")]
    assert rows[0].meta == {"solution": "3 + 4 = <<3+4=7>>7\n#### 7"}


def test_boxed_format_reads_nested_braces_and_prefers_an_answer_field(tmp_path):
    p = _write(tmp_path / "math.jsonl", [
        {"problem": "Simplify", "solution": "We get $\\boxed{\\frac{\\sqrt{2}}{2}}$.", "level": "Level 2"},
        {"problem": "Two boxes", "solution": "first \\boxed{1}, finally \\boxed{\\{1, 2\\}}"},
        {"problem": "Given", "solution": "long work", "answer": "\\boxed{42}"},
        {"problem": "Only answer", "answer": 3.5},
    ])
    rows = load_rows(p, "boxed")
    assert [r.answer for r in rows] == ["\\frac{\\sqrt{2}}{2}", "\\{1, 2\\}", "42", "3.5"]
    assert rows[0].meta == {"level": "Level 2", "solution": rows[0].meta["solution"]}
    # prompt_answer auto-detects the same rows (plain, GSM8K and boxed) in one file
    auto = load_rows(p, "prompt_answer")
    assert [r.answer for r in auto] == ["\\frac{\\sqrt{2}}{2}", "\\{1, 2\\}", "42", "3.5"]


@pytest.mark.parametrize("fmt,bad,reason", [
    ("gsm8k", {"question": "q", "answer": "no hashes here"}, "field 'answer' has no final answer after '#### '"),
    ("gsm8k", {"question": "q", "answer": "x\n####   "}, "has no final answer"),
    ("gsm8k", {"answer": "#### 1"}, "missing field 'question'"),
    ("gsm8k", {"question": "q"}, "missing field 'answer'"),
    ("boxed", {"problem": "q", "solution": "ends \\boxed{\\frac{1}{2}"}, "no \\boxed{...} answer in field 'solution'"),
    ("boxed", {"problem": "q", "solution": "no box"}, "no \\boxed{...} answer"),
    ("boxed", {"problem": "q"}, "missing field 'solution'"),
    ("boxed", {"problem": "q", "answer": ""}, "field 'answer' must be a non-empty string or number"),
    ("boxed", {"problem": "", "solution": "\\boxed{1}"}, "field 'problem' is empty"),
])
def test_math_format_bad_rows_name_file_and_line(tmp_path, fmt, bad, reason):
    p = _write(tmp_path / "d.jsonl", [{"question": "ok", "problem": "ok", "answer": "#### 1",
                                       "solution": "\\boxed{1}"}, bad])
    with pytest.raises(DataRowError) as e:
        load_rows(p, fmt)
    assert str(e.value).startswith(f"{p}:2: ") and reason in str(e.value), str(e.value)


def test_skipping_bad_rows_counts_them_with_the_length_filter(tmp_path, tok, caplog):
    rows = [{"question": f"{i}+{i}=", "answer": f"#### {2 * i}"} for i in range(6)]
    rows[1] = {"question": "1+1=", "answer": "no final"}          # bad: no ####
    rows[3] = "{oops"                                               # bad: invalid JSON
    rows[4] = {"question": "4+4=" * 20, "answer": "#### 8"}         # too long
    p = _write(tmp_path / "mix.jsonl", rows)
    with pytest.raises(DataRowError, match=r"mix\.jsonl:2: "):
        PromptAnswerDataset.load(p, tok, max_prompt_len=16, fmt="gsm8k")
    with caplog.at_level(logging.WARNING, logger="realflow.data.dataset"):
        ds = PromptAnswerDataset.load(p, tok, max_prompt_len=16, fmt="gsm8k", skip_bad_rows=True)
    assert ds.ids == ["mix-1", "mix-3", "mix-6"]
    assert (ds.report.total, ds.report.kept) == (6, 3)
    assert ds.report.dropped == {"bad_row": 2, "prompt_too_long": 1}
    assert "kept 3/6 rows (dropped 3: bad_row: 2, prompt_too_long: 1)" == str(ds.report)
    logged = [r.getMessage() for r in caplog.records]
    assert any(f"{p}:2: field 'answer' has no final answer" in m for m in logged)
    assert any(f"{p}:4: invalid JSON" in m for m in logged)
    with pytest.raises(DataRowError, match=r"no valid rows \(2 bad rows; first: .*:1: "):
        load_rows_report(_write(tmp_path / "allbad.jsonl", ["[1]", "{x"]), "gsm8k")


def _chat_tok(tok_dir):
    t = AutoTokenizer.from_pretrained(tok_dir)
    t.chat_template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                       "{% if add_generation_prompt %}[assistant]{% endif %}")
    return t


def test_chat_template_and_prompt_template(tmp_path, tok, arith):
    ct = _chat_tok(tok.name_or_path)
    rows = load_rows(arith.test, "prompt_answer")[:5]
    plain = PromptAnswerDataset.from_rows(rows, ct, max_prompt_len=512, prompt_format=PromptFormat("none"))
    assert plain[0].prompt_ids == tok(rows[0].prompt)["input_ids"]  # chat_template=none: the text as it is
    auto = PromptAnswerDataset.from_rows(rows, ct, max_prompt_len=512)  # default auto: the tokenizer's template
    assert auto[0].prompt_ids == tok(f"<s>[user]{rows[0].prompt}[assistant]", add_special_tokens=False)["input_ids"]
    assert PromptAnswerDataset.from_rows(rows, tok, max_prompt_len=512)[0].prompt_ids == plain[0].prompt_ids
    fmt = PromptFormat(chat_template=True, system_prompt="sys", prompt_template="Q: {prompt}")
    ds = PromptAnswerDataset.from_rows(rows, ct, max_prompt_len=512, prompt_format=fmt)
    text = f"<s>[system]sys[user]Q: {rows[0].prompt}[assistant]"
    assert ds[0].prompt_ids == tok(text, add_special_tokens=False)["input_ids"]
    assert ds[0].prompt_ids.count(tok.bos_token_id) == 1  # the template owns BOS; not added twice
    sft = SFTDataset.from_rows(load_rows(arith.train, "sft")[:3], ct, 512, prompt_format=fmt)
    assert sft[0].input_ids[:sft[0].prompt_len] == tok(
        f"<s>[system]sys[user]Q: {load_rows(arith.train, 'sft')[0].prompt}[assistant]",
        add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="has no chat template"):
        PromptAnswerDataset.from_rows(rows, tok, 512, prompt_format=PromptFormat(chat_template=True))
    with pytest.raises(ValueError, match="must contain '\\{prompt\\}'"):
        PromptFormat(prompt_template="no slot")
    with pytest.raises(ValueError, match="not a valid template"):
        PromptFormat(prompt_template="{prompt} {other}")
    with pytest.raises(ValueError, match="system_prompt needs a chat template"):
        PromptFormat("none", system_prompt="x")
    with pytest.raises(ValueError, match="has no chat template"):
        PromptAnswerDataset.from_rows(rows, tok, 512, prompt_format=PromptFormat(system_prompt="x"))


# ----------------------------------------------------------------------------- data source


def test_data_source_keys_and_shards_for_math_formats(tmp_path, tok, caplog):
    p = _write(tmp_path / "g.jsonl", [{"question": f"{i}+1=", "answer": f"work\n#### {i + 1}"} for i in range(7)]
               + ["{bad"])
    for fmt in ("gsm8k", "prompt_answer"):
        assert dataset_keys(DatasetSpec(fmt, str(p))) == ("packed_prompts", "answer")
    assert dataset_keys(DatasetSpec("boxed", str(p))) == ("packed_prompts", "answer")
    assert dataset_keys(DatasetSpec("sft", str(p))) == ("packed_input_ids", "prompt_mask", "answer")
    spec = DatasetSpec("gsm8k", str(p), {"max_prompt_len": 64, "skip_bad_rows": True})
    with caplog.at_level(logging.INFO, logger="realflow.data.source"):
        shards = [load_dataset_shard(spec, tok, r, 2) for r in range(2)]
    assert sorted(b.ids[0] for s in shards for b in s) == [f"g-{i}" for i in range(1, 8)]
    b = shards[0][0]
    assert b.data["packed_prompts"].tolist() == tok("0+1=")["input_ids"] and b.metadata["answer"] == ["1"]
    assert any("kept 7/8 rows (dropped 1: bad_row: 1)" in r.getMessage() for r in caplog.records)
    ct = _chat_tok(tok.name_or_path)
    chat_spec = DatasetSpec("gsm8k", str(p), {"chat_template": True, "skip_bad_rows": True})
    chat = load_dataset_shard(chat_spec, ct, 0, 1)
    expect = tok("<s>[user]0+1=[assistant]", add_special_tokens=False)["input_ids"]
    assert chat[0].data["packed_prompts"].tolist() == expect
    with pytest.raises(ValueError, match=r"unknown args \['max_promt_len'\]; did you mean 'max_prompt_len'"):
        load_dataset_shard(DatasetSpec("gsm8k", str(p), {"max_promt_len": 3}), tok, 0, 1)
    with pytest.raises(ValueError, match="no rows left after filtering"):
        load_dataset_shard(DatasetSpec("gsm8k", str(p), {"max_prompt_len": 1, "skip_bad_rows": True}), tok, 0, 1)
    with pytest.raises(ValueError, match="format 'gsm8' has no sample keys.*did you mean 'gsm8k'"):
        dataset_keys(DatasetSpec("gsm8", str(p)))


def test_user_format_keys_come_from_the_parser_annotation(tmp_path):
    from realflow.data.dataset import PromptAnswerRow, SFTRow

    def parse_qa(raw) -> PromptAnswerRow:
        return PromptAnswerRow(id="", prompt=raw["q"], answer=str(raw["a"]))

    def parse_pair(raw) -> SFTRow:
        return SFTRow(id="", prompt=raw["q"], response=raw["r"])

    def parse_untyped(raw):
        return parse_qa(raw)

    for name, fn in [("test_qa2", parse_qa), ("test_pair", parse_pair), ("test_untyped", parse_untyped)]:
        DATASET_FORMATS.register(name, fn)
    try:
        assert dataset_keys(DatasetSpec("test_qa2", "x")) == ("packed_prompts", "answer")
        assert dataset_keys(DatasetSpec("test_pair", "x")) == ("packed_input_ids", "prompt_mask", "answer")
        with pytest.raises(ValueError, match="must be annotated"):
            dataset_keys(DatasetSpec("test_untyped", "x"))
    finally:
        for name in ("test_qa2", "test_pair", "test_untyped"):
            DATASET_FORMATS.unregister(name)
