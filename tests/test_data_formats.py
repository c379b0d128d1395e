"""The data users bring: every file type, every row shape, the field mapping, the chat rendering.

Real files only: jsonl and json written here, parquet written with pyarrow, a directory saved by
``datasets`` itself, and a real-format fast tokenizer with a ChatML chat template
(tests/user_model_fixture.py). The reference for every rendered prompt is transformers'
own ``apply_chat_template``.
"""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from user_model_fixture import make_chat_tokenizer

from realflow.data.chat_render import ChatTemplateError, PromptFormat, conversation_ids, load_template_file, prompt_ids
from realflow.data.readers import read_records
from realflow.data.source import load_dataset_shard, load_tokenized
from realflow.data.dataset import DataRowError, FieldMap, SFTDataset, load_rows
from realflow.api.experiment import DatasetSpec
from realflow.base.tokenizer_loading import load_tokenizer

Q = "Natalia sold clips to 48 friends in April, and half as many in May. How many in all?"
GSM8K = {"question": Q, "answer": "In May she sold 48/2 = 24.\n48+24 = 72\n#### 72"}
VERL = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": Q}], "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"}, "extra_info": {"split": "train", "index": 0}}
TRL_RL = {"prompt": [{"role": "system", "content": "Think step by step."}, {"role": "user", "content": Q}],
          "solution": "72"}
MESSAGES = {"messages": [{"role": "user", "content": Q}, {"role": "assistant", "content": "48+24=72 #### 72"}]}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(make_chat_tokenizer(str(tmp_path_factory.mktemp("tok") / "chat")))


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _chat_ids(tok, messages):
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


# ----------------------------------------------------------------------------- files

def test_every_file_type_reads_the_same_rows(tmp_path):
    import datasets

    rows = [dict(GSM8K, id=f"r{i}") for i in range(5)]
    jsonl = _jsonl(tmp_path / "d.jsonl", rows)
    arr = tmp_path / "d.json"
    arr.write_text(json.dumps(rows, indent=2))
    lines_json = _jsonl(tmp_path / "lines.json", rows)  # datasets' to_json writes JSON lines under .json
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    want = [(r["id"], r["question"]) for r in rows]
    for path in (jsonl, str(arr), lines_json, str(tmp_path / "d.parquet"), str(tmp_path / "saved")):
        got = load_rows(path, "prompt_answer")
        assert [(r.id, r.prompt) for r in got] == want, path
        assert {r.answer for r in got} == {"72"}
    # a JSON array's rows are numbered by the line they start on
    assert [n for n, _, unit in read_records(arr)] == [2, 7, 12, 17, 22]  # 5 lines per row


def test_file_errors_name_the_file_and_what_to_do(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list([GSM8K]),
                               "test": datasets.Dataset.from_list([GSM8K])})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataRowError, match=r"DatasetDict with splits .*train.*point at one split, e\.g\. .*/dd/"):
        load_rows(str(tmp_path / "dd"))
    assert len(load_rows(str(tmp_path / "dd" / "train"))) == 1
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataRowError, match=r"unknown data file type '\.csv'; use \.jsonl, \.json, \.parquet"):
        load_rows(str(tmp_path / "d.csv"))
    (tmp_path / "bad.json").write_text('[\n{"question": "q", "answer": "1"},\n{"question": 3, "answer": "1"}\n]')
    with pytest.raises(DataRowError, match=r"bad\.json:3: field 'question' must be a string"):
        load_rows(str(tmp_path / "bad.json"))


def test_parquet_without_the_prompt_column_names_file_row_and_field(tmp_path):
    pq.write_table(pa.Table.from_pylist([{"query": Q, "answer": "72"}] * 3), tmp_path / "train.parquet")
    with pytest.raises(DataRowError) as e:
        load_rows(str(tmp_path / "train.parquet"))
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'train.parquet'}: row 1: missing field 'prompt' or 'question'"), msg
    assert "dataset.prompt_key" in msg
    rows = load_rows(str(tmp_path / "train.parquet"), fields=FieldMap(prompt_key="query"))
    assert rows[0].prompt == Q and rows[0].id == "train-1"


# ----------------------------------------------------------------------------- rows

def test_row_shapes_users_bring(tmp_path):
    verl = str(tmp_path / "verl.parquet")
    pq.write_table(pa.Table.from_pylist([VERL]), verl)
    (r,) = load_rows(verl)
    assert r.prompt == VERL["prompt"] and r.answer == "72" and r.meta["data_source"] == "openai/gsm8k"
    (r,) = load_rows(_jsonl(tmp_path / "trl.jsonl", [TRL_RL]))
    assert r.prompt == TRL_RL["prompt"] and r.answer == "72"
    (r,) = load_rows(_jsonl(tmp_path / "msgs.jsonl", [MESSAGES]))
    assert r.prompt == MESSAGES["messages"][:1] and r.answer == "72"  # the last reply's final answer
    (r,) = load_rows(_jsonl(tmp_path / "gsm.jsonl", [GSM8K]))
    assert r.prompt == Q and r.answer == "72"
    custom = {"instruction": Q, "meta": {"gold": 72}}
    (r,) = load_rows(_jsonl(tmp_path / "custom.jsonl", [custom]),
                     fields=FieldMap(prompt_key="instruction", answer_key="meta.gold"))
    assert r.prompt == Q and r.answer == "72"
    with pytest.raises(DataRowError, match=r"custom\.jsonl:1: missing field 'meta\.golden' \(dataset\.answer_key"):
        load_rows(str(tmp_path / "custom.jsonl"), fields=FieldMap(prompt_key="instruction", answer_key="meta.golden"))
    bad_role = {"prompt": [{"role": "bot", "content": "hi"}], "answer": "1"}
    with pytest.raises(DataRowError, match=r"b\.jsonl:1: field 'prompt'\[0\]: role 'bot' is not one of"):
        load_rows(_jsonl(tmp_path / "b.jsonl", [bad_role]))


def test_sft_rows_messages_and_trl_completions(tmp_path):
    conv = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"},
                         {"role": "assistant", "content": "5"}, {"role": "user", "content": "and 4+4?"},
                         {"role": "assistant", "content": "8"}]}
    trl = {"prompt": [{"role": "user", "content": "2+3?"}], "completion": [{"role": "assistant", "content": "5"}]}
    rows = load_rows(_jsonl(tmp_path / "sft.jsonl", [conv, trl, {"prompt": "2+3?", "response": "5"}]), "sft")
    assert rows[0].messages == conv["messages"] and rows[0].response == "8"
    assert rows[1].messages == trl["prompt"] + trl["completion"]
    assert rows[2].messages is None
    with pytest.raises(DataRowError, match="has no assistant turn to train on"):
        load_rows(_jsonl(tmp_path / "x.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}]), "sft")


# ----------------------------------------------------------------------------- rendering

def test_prompts_render_as_apply_chat_template(tmp_path, tok):
    path = _jsonl(tmp_path / "mix.jsonl", [dict(GSM8K, id="g"), dict(TRL_RL, id="t"), dict(MESSAGES, id="m")])
    ds = load_tokenized(DatasetSpec("prompt_answer", path, {"max_prompt_len": 512}), tok)
    assert ds[0].prompt_ids == _chat_ids(tok, [{"role": "user", "content": Q}])
    assert ds[1].prompt_ids == _chat_ids(tok, TRL_RL["prompt"])
    assert ds[2].prompt_ids == _chat_ids(tok, MESSAGES["messages"][:1])
    sys = load_tokenized(DatasetSpec("prompt_answer", path, {"system_prompt": "Answer with #### N."}), tok)
    assert sys[0].prompt_ids == _chat_ids(tok, [{"role": "system", "content": "Answer with #### N."},
                                                {"role": "user", "content": Q}])
    assert sys[1].prompt_ids == ds[1].prompt_ids  # a conversation with its own system turn keeps it
    plain = _jsonl(tmp_path / "plain.jsonl", [GSM8K, VERL])
    raw = load_tokenized(DatasetSpec("prompt_answer", plain, {"chat_template": "none"}), tok)
    assert raw[0].prompt_ids == raw[1].prompt_ids == tok(Q)["input_ids"]  # one user turn is its text
    no_gen = load_tokenized(DatasetSpec("prompt_answer", path, {"add_generation_prompt": False}), tok)
    assert no_gen[0].prompt_ids == list(tok.apply_chat_template([{"role": "user", "content": Q}],
                                                                tokenize=True)["input_ids"])
    with pytest.raises(ChatTemplateError, match="row 't': a conversation of 2 messages needs a chat template"):
        load_tokenized(DatasetSpec("prompt_answer", path, {"chat_template": "none"}), tok)
    shard = load_dataset_shard(DatasetSpec("prompt_answer", path, {}), tok, 1, 2)
    assert shard[0].data["packed_prompts"].tolist() == ds[1].prompt_ids  # what the workers get


def test_template_file_renders_and_bad_files_name_file_and_line(tmp_path, tok):
    good = tmp_path / "t.jinja"
    good.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[assistant] {% endif %}")
    text = load_template_file(str(good))
    ids = prompt_ids(tok, "2+3?", PromptFormat("tokenizer", template_text=text))
    assert tok.decode(ids) == "[user] 2+3?\n[assistant] "
    bad = tmp_path / "bad.jinja"
    bad.write_text("line one\n{% for m in messages %}\n{{ m.content }\n")
    with pytest.raises(ChatTemplateError, match=r"bad\.jinja:3: not a valid Jinja template"):
        load_template_file(str(bad))
    with pytest.raises(ChatTemplateError, match=r"cannot read .*missing\.jinja"):
        load_template_file(str(tmp_path / "missing.jinja"))


def test_sft_conversation_trains_on_assistant_tokens_only(tmp_path, tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"},
            {"role": "assistant", "content": "5"}, {"role": "user", "content": "and 4+4?"},
            {"role": "assistant", "content": "8"}]
    ids, mask = conversation_ids(tok, msgs)
    assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False)
    assert tok.decode([i for i, m in zip(ids, mask) if m == 0]) == "5<|im_end|>\n8<|im_end|>\n"
    # the same tokens transformers marks as assistant tokens with a {% generation %} template
    marked = make_chat_tokenizer(str(tmp_path / "marked"), assistant_mask=True)
    mt = load_tokenizer(marked)
    out = mt.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert list(out["input_ids"]) == ids
    assistant = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tok.decode(assistant).replace("\n", "") == "5<|im_end|>8<|im_end|>"
    rows = load_rows(_jsonl(tmp_path / "s.jsonl", [{"messages": msgs}, {"prompt": "2+3?", "response": "5"}]), "sft")
    ds = SFTDataset.from_rows(rows, tok, max_prompt_len=512)
    assert ds[0].input_ids == ids and ds[0].prompt_mask == mask
    plain_chat = conversation_ids(tok, [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}])
    assert (ds[1].input_ids, ds[1].prompt_mask) == plain_chat  # a text pair is a two-turn conversation
    assert ds.report.longest_prompt == len(_chat_ids(tok, msgs[:2]))


def test_the_agents_proxy_renders_as_the_data_sets(tmp_path, tok):
    """The OpenAI-compatible proxy's prompt ids equal the data sets' for the same messages, with the
    tokenizer's template and with a template file (which the rollout worker hands the proxy)."""
    from realflow.rollout.chat_tokens import ChatTokenizer

    msgs = TRL_RL["prompt"]
    proxy = ChatTokenizer(tok)
    assert proxy.encode(proxy.render(msgs, None)) == prompt_ids(tok, msgs) == _chat_ids(tok, msgs)
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                    "{% if add_generation_prompt %}<assistant>{% endif %}")
    text = load_template_file(str(path))
    proxy = ChatTokenizer(tok, text)
    assert proxy.encode(proxy.render(msgs, None)) == prompt_ids(tok, msgs, PromptFormat("tokenizer", template_text=text))
