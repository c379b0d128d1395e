"""A user data source: rows of a user format become samples with the keys the user declares
(here preference pairs: two sequences per sample), through the same parsing, bad-row
reporting and sharding as the built-in formats."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoTokenizer

from experiments.tasks.arithmetic import ensure_dataset
from experiments.tasks.tokenizer import ensure_tokenizer
from realflow.api.batch import SequenceBatch
from realflow.data.source import DATA_SOURCES, dataset_keys, load_dataset_shard, register_data_source
from realflow.data.dataset import DATASET_FORMATS, DataRowError
from realflow.api.experiment import DatasetSpec


@dataclass(frozen=True)
class PairRow:
    id: str
    prompt: str
    chosen: str
    rejected: str


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    data = ensure_dataset(tmp_path_factory.mktemp("arith"), 500, 20, seed=0, difficulty=2)
    return AutoTokenizer.from_pretrained(ensure_tokenizer(tmp_path_factory.mktemp("tok") / "t", [data.train]))


@pytest.fixture(scope="module", autouse=True)
def pairs_format():
    @DATASET_FORMATS.register("test_pairs")
    def parse(raw: dict) -> PairRow:
        return PairRow("", str(raw["prompt"]), str(raw["chosen"]), str(raw["rejected"]))

    @register_data_source("test_pairs", keys=("pair_input_ids", "pair_prompt_lens"), args=("max_len",))
    def to_sample(row: PairRow, tokenizer, args: dict) -> SequenceBatch | None:
        prompt = tokenizer(row.prompt)["input_ids"]
        seqs = [prompt + tokenizer(r, add_special_tokens=False)["input_ids"] for r in (row.chosen, row.rejected)]
        if max(map(len, seqs)) > int(args.get("max_len", 64)):
            return None
        return SequenceBatch(ids=[row.id], seqlens={"pair_input_ids": [[len(s) for s in seqs]]},
                             data={"pair_input_ids": torch.tensor(seqs[0] + seqs[1])},
                             metadata={"pair_prompt_lens": [len(prompt)]})
    yield
    DATASET_FORMATS.unregister("test_pairs")
    DATA_SOURCES.unregister("test_pairs")


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_user_source_declares_its_keys_and_shards_its_samples(tmp_path, tok):
    rows = [{"id": f"p{i}", "prompt": f"{i}+1=", "chosen": f"#### {i + 1}", "rejected": f"#### {i + 2}"}
            for i in range(7)]
    rows.append({"id": "long", "prompt": "1+1=" * 40, "chosen": "#### 2", "rejected": "#### 3"})
    spec = DatasetSpec(format="test_pairs", path=_write(tmp_path / "pairs.jsonl", rows), args={"max_len": 40})
    assert dataset_keys(spec) == ("pair_input_ids", "pair_prompt_lens")
    shards = [load_dataset_shard(spec, tok, r, 2) for r in range(2)]
    ids = [b.ids[0] for s in shards for b in s]
    assert sorted(ids) == sorted(f"p{i}" for i in range(7))  # "long" filtered; shards disjoint and complete
    assert [len(s) for s in shards] == [4, 3]
    b = shards[0][0]
    chosen, rejected = b.seqlens["pair_input_ids"][0]
    p = b.metadata["pair_prompt_lens"][0]
    seq = b.data["pair_input_ids"].tolist()
    assert seq[:p] == seq[chosen:chosen + p]  # both sequences start with the prompt
    assert tok.decode(seq[p:chosen]) == "#### 1" and tok.decode(seq[chosen + p:]) == "#### 2"


def test_bad_rows_and_args_are_named(tmp_path, tok):
    path = _write(tmp_path / "bad.jsonl", [{"prompt": "1+1=", "chosen": "2", "rejected": "3"},
                                           {"prompt": "1+2=", "chosen": "3"}])
    with pytest.raises(DataRowError, match=r"bad.jsonl:2: missing field 'rejected'"):
        load_dataset_shard(DatasetSpec(format="test_pairs", path=path), tok, 0, 1)
    ok = load_dataset_shard(DatasetSpec(format="test_pairs", path=path, args={"skip_bad_rows": True}), tok, 0, 1)
    assert len(ok) == 1
    with pytest.raises(ValueError, match=r"unknown args \['max_lne'\].*max_len"):
        load_dataset_shard(DatasetSpec(format="test_pairs", path=path, args={"max_lne": 3}), tok, 0, 1)
    with pytest.raises(ValueError, match="cannot feed 2 data-parallel ranks"):
        load_dataset_shard(DatasetSpec(format="test_pairs", path=path, args={"skip_bad_rows": True}), tok, 0, 2)
