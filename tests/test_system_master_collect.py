"""The master's bookkeeping of MFC replies (``Master._collect``): who holds each output, the batch's new
key sizes, stats averaged over dp heads, hook times, and a clear error when an MFC leaves outputs out.

The replies here have the exact shape model workers send (``SequenceBatch.meta_wire`` per dp head);
the end-to-end path through real workers is covered by the SFT/PPO system tests.
"""
from __future__ import annotations

import json
import os

import pytest

from realflow.api.batch import SequenceBatch
from realflow.api.experiment import DatasetSpec, ExperimentSetup, ModelSpec, OptimizerConfig
from realflow.api.mfc import MFCDef
from realflow.system.master import Master, MasterError
from realflow.system.plan import compile_plan

IDS = [f"s{i}" for i in range(4)]


def _setup(tmp_path) -> ExperimentSetup:
    path = tmp_path / "model"
    os.makedirs(path)
    with open(path / "config.json", "w") as f:  # all the plan's layout checks read
        json.dump(dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=160, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256), f)
    mfcs = [MFCDef("score", "actor", "inference", "x", input_keys=("packed_prompts",),
                   output_keys=("rewards", "answer_ok"), n_seqs=len(IDS)),
            MFCDef("train", "actor", "train_step", "x", input_keys=("packed_prompts", "rewards"), n_seqs=len(IDS))]
    models = {"actor": ModelSpec("actor", str(path), optimizer=OptimizerConfig())}
    return ExperimentSetup("collect_test", "t0", mfcs, models, DatasetSpec("prompt_answer", "unused.jsonl"),
                           2, "d2", str(tmp_path / "run"))


def _master(tmp_path) -> tuple[Master, SequenceBatch]:
    import parallel.backend  # noqa: F401  (registers the "megatron" backend the plan checks layouts with)

    setup = _setup(tmp_path)
    master = Master(setup, compile_plan(setup), endpoint=None)
    batch = SequenceBatch(IDS, {"packed_prompts": [[3], [5], [2], [4]]}, {"packed_prompts": None})
    return master, batch


def _outputs(ids: list[str], rewards_lens: list[int]) -> dict:
    """What a dp head replies: the metadata of its output batch."""
    import torch

    out = SequenceBatch(ids, {"rewards": [[n] for n in rewards_lens]}, {"rewards": torch.zeros(sum(rewards_lens))},
                        {"answer_ok": [True] * len(ids)})
    return {"stats": {"reward": float(len(ids))}, "outputs": out.meta_wire()}


def test_outputs_of_both_dp_heads_are_recorded_and_sizes_learned(tmp_path):
    master, batch = _master(tmp_path)
    score, _ = master.setup.mfcs
    replies = {1: _outputs(["s2", "s0"], [1, 2]), 2: _outputs(["s1", "s3"], [3, 1]), 7: {"seconds": 0.5},
               8: {"seconds": 1.5}}
    results = master._collect([score], batch, replies, {1: (score, 0), 2: (score, 1)},
                              {7: ("score", "pre"), 8: ("score", "pre")})
    assert master.holders.holders("s0", "rewards") == [0] and master.holders.holders("s3", "answer_ok") == [1]
    assert batch.seqlens["rewards"] == [[2], [3], [1], [1]]  # in the batch's order, not the replies'
    assert batch.data["rewards"] is None  # the master holds metadata only
    assert "answer_ok" not in batch.seqlens  # metadata keys have no sizes
    assert results == {"score": {"reward": 2.0, "hooks_pre_s": 1.5}}  # mean over dp heads; slowest hook


def test_train_step_stats_come_from_the_head_and_need_no_outputs(tmp_path):
    master, batch = _master(tmp_path)
    _, train = master.setup.mfcs
    replies = {3: {"stats": {"loss": 2.0}, "outputs": None}, 4: {"stats": None, "outputs": None}}
    assert master._collect([train], batch, replies, {3: (train, 0), 4: (train, 1)}, {}) == {"train": {"loss": 2.0}}


def test_an_output_left_out_names_the_mfc_key_and_a_sample(tmp_path):
    master, batch = _master(tmp_path)
    score, _ = master.setup.mfcs
    replies = {1: _outputs(["s0", "s1"], [1, 1]), 2: _outputs(["s3"], [1])}  # s2 went missing on dp rank 1
    with pytest.raises(MasterError, match=r"MFC 'score' did not produce key 'rewards' for 1 samples \(e.g. s2\)"):
        master._collect([score], batch, replies, {1: (score, 0), 2: (score, 1)}, {})
    assert "rewards" not in batch.seqlens  # sizes are learned only when every sample reported


def test_malformed_reply_names_the_mfc_and_worker(tmp_path):
    master, batch = _master(tmp_path)
    score, _ = master.setup.mfcs
    bad = {"stats": None, "outputs": {"ids": [0, 1], "seqlens": {}, "data": {}, "metadata": {}}}
    with pytest.raises(MasterError, match=r"MFC 'score': worker model_worker/1 returned malformed output"):
        master._collect([score], batch, {5: bad}, {5: (score, 1)}, {})


def _serve_shards(master: Master, shards: dict[int, list[str]]) -> dict[int, list[str]]:
    """Answer the master's fetch/drop requests from real ``ShardStream``s (what each model worker
    runs) instead of over sockets; returns what each worker was told to drop."""
    import torch

    from realflow.system.data_stream import ShardStream

    streams = {w: ShardStream([SequenceBatch([i], {"packed_prompts": [[1]]}, {"packed_prompts": torch.zeros(1)})
                               for i in ids], seed=w + 1) for w, ids in shards.items()}
    dropped: dict[int, list[str]] = {w: [] for w in shards}

    def _all(handler, payload, timeout, workers=None):
        out = {}
        for w in (workers if workers is not None else sorted(streams)):
            if handler == "fetch":
                b, done = streams[w].next(payload["n"])
                out[w] = {"batch": None if b is None else b.meta().to_wire(), "epoch_done": done}
            else:
                assert handler == "drop"
                dropped[w].extend(payload["ids"])
                out[w] = {"dropped": len(payload["ids"])}
        return out

    master._all = _all
    return dropped


def test_a_batch_straddling_an_epoch_boundary_takes_no_sample_twice(tmp_path):
    master, _ = _master(tmp_path)
    master.batch_size = 4
    shards = {w: [f"w{w}-{i}" for i in range(5)] for w in range(2)}  # 10 samples: epochs end mid-batch
    _serve_shards(master, shards)
    counts: dict[str, int] = {}
    for _ in range(10):
        batch = master._fetch_batch()
        assert len(batch) == 4 and len(set(batch.ids)) == 4, batch.ids
        master.holders.drop(batch.ids)
        for i in batch.ids:
            counts[i] = counts.get(i, 0) + 1
    assert sorted(counts) == sorted(shards[0] + shards[1])  # every sample trained
    assert max(counts.values()) - min(counts.values()) <= 2 and master.epoch >= 3, (counts, master.epoch)


def test_a_batch_larger_than_the_data_set_is_a_clear_error(tmp_path):
    master, _ = _master(tmp_path)
    master.batch_size = 12
    _serve_shards(master, {w: [f"w{w}-{i}" for i in range(5)] for w in range(2)})
    with pytest.raises(MasterError, match="batch_size=12 is larger than the data set: the workers hold 10 distinct"):
        master._fetch_batch()
