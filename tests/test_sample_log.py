"""log_samples: the trainer's sample records and the generation server's request log."""
from __future__ import annotations

import json

import torch

from realflow.api.batch import SequenceBatch
from realflow.api.generation import GenerationResult
from realflow.rollout.request_log import RequestLog
from realflow.system.sample_log import TrainSampleLog, sample_records


def _batch() -> SequenceBatch:
    # two samples of two sequences each: prompt [1,2] + answers
    seqs = [[1, 2, 7], [1, 2, 8, 9], [3, 4, 5], [3, 6]]
    masks = [[1, 1, 0], [1, 1, 0, 0], [1, 1, 0], [1, 0]]
    return SequenceBatch(
        ids=["a", "b"],
        seqlens={"packed_input_ids": [[3, 4], [3, 2]], "prompt_mask": [[3, 4], [3, 2]], "rewards": [[1, 1], [1, 1]]},
        data={"packed_input_ids": torch.tensor(sum(seqs, [])), "prompt_mask": torch.tensor(sum(masks, [])).bool(),
              "rewards": torch.tensor([1.0, 0.0, 0.5, -1.0])},
        metadata={"answer": ["5", {"x": 1}]})


def test_records_split_prompt_and_answer_and_carry_per_sequence_scalars():
    recs = sample_records(_batch(), 1, decode=lambda ids: " ".join(map(str, ids)))
    assert len(recs) == 1 and recs[0]["id"] == "a" and recs[0]["metadata"] == {"answer": "5"}
    s0, s1 = recs[0]["sequences"]
    assert s0 == {"input_ids": [1, 2, 7], "prompt_len": 2, "prompt": "1 2", "answer": "7", "rewards": 1.0}
    assert s1["answer"] == "8 9" and s1["rewards"] == 0.0
    assert [r["id"] for r in sample_records(_batch(), 5)] == ["a", "b"]  # fewer samples than asked: all
    no_ids = SequenceBatch(ids=["a"], seqlens={"x": [[1]]}, data={"x": torch.zeros(1)})
    assert sample_records(no_ids, 3) == []  # a batch without token ids (e.g. a reward-only MFC) logs nothing


def test_train_log_appends_per_mfc_and_survives_a_missing_tokenizer(tmp_path):
    log = TrainSampleLog(str(tmp_path / "samples"), 1, tokenizer_of=lambda name: None)
    log.write("actor_train", "actor", 1, _batch())
    log.write("actor_train", "actor", 2, _batch())
    lines = [json.loads(x) for x in (tmp_path / "samples" / "actor_train.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and "prompt" not in lines[0]["sequences"][0]


def test_request_log_stops_at_its_limit(tmp_path):
    path = tmp_path / "logs" / "gen.jsonl"
    log = RequestLog(str(path), 3, decode=lambda ids: "".join(chr(96 + i) for i in ids))
    res = [GenerationResult(rid=f"r{i}", prompt_ids=[1, 2], output_ids=[3], output_logprobs=[-0.1],
                            output_versions=[4], finish_reason={"type": "stop"}, request_rid="r") for i in range(2)]
    log.record(res)
    log.record(res)
    log.record(res)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["rid"] for x in lines] == ["r0", "r1", "r0"]
    assert lines[0] == {"rid": "r0", "request_rid": "r", "prompt_ids": [1, 2], "output_ids": [3],
                        "finish_reason": {"type": "stop"}, "weight_version": 4, "prompt": "ab", "output": "c"}
