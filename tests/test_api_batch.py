"""SequenceBatch / MicroBatchSpec: validation, selection, split, micro-batches, gather, wire format."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from realflow.api.batch import BatchError, MicroBatchSpec, SequenceBatch

torch.set_num_threads(1)
KEY = "packed_input_ids"


def make_batch(groups: list[list[int]], with_logp: bool = True, prefix: str = "s") -> SequenceBatch:
    """Sample i holds sequences of lengths groups[i]; token values encode (sample, position)."""
    ids = [f"{prefix}{i}" for i in range(len(groups))]
    data = {KEY: [[torch.full((n,), 1000 * i + j, dtype=torch.int64) for j, n in enumerate(g)] for i, g in enumerate(groups)]}
    if with_logp:
        data["logprobs"] = [[torch.randn(n, dtype=torch.float32) for n in g] for g in groups]
        data["rewards"] = [[torch.tensor([float(i)]) for _ in g] for i, g in enumerate(groups)]  # one per sequence
    return SequenceBatch.from_samples(ids, data, {"answer": [f"a{i}" for i in range(len(groups))]})


# ---- construction and validation ----------------------------------------------------------------


def test_from_samples_groups_and_accessors():
    b = make_batch([[3, 2], [4], [1, 1, 1]])
    assert len(b) == 3 and b.keys == {KEY, "logprobs", "rewards", "answer"}
    assert b.seqlens[KEY] == [[3, 2], [4], [1, 1, 1]] and b.seqlens["rewards"] == [[1, 1], [1], [1, 1, 1]]
    assert b.data[KEY].shape == (12,) and b.sample_tokens() == [5, 4, 3] and b.total_tokens() == 12
    assert b.cu_seqlens().tolist() == [0, 3, 5, 9, 10, 11, 12] and b.cu_seqlens().dtype == torch.int32
    seqs = b.sequences(KEY, 0)
    assert [s.tolist() for s in seqs] == [[0, 0, 0], [1, 1]]
    assert b.sequences(KEY, 2)[2].tolist() == [2002]
    assert "n=3" in repr(b)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(data={KEY: torch.zeros(5, dtype=torch.long)}), "key 'packed_input_ids': tensor dim 0 is 5 but its seqlens sum to 6"),
    (dict(ids=["a", "a"]), "duplicate sample id 'a'"),
    (dict(ids=["a", 3]), "sample ids must be str"),
    (dict(seqlens={KEY: [[2], [4]], "x": [[1], [1]]}), "keys with seqlens but no data entry: ['x']"),
    (dict(seqlens={KEY: [[6]]}), "key 'packed_input_ids': seqlens has 1 samples but the batch has 2 ids"),
    (dict(seqlens={KEY: [[7, -1], [0]]}), "negative sequence length"),
    (dict(seqlens={KEY: [[2], "x"]}), "seqlens must be a list"),
    (dict(data={KEY: torch.tensor(3)}), "at least one dimension"),
    (dict(data={KEY: [1, 2]}), "must be a torch.Tensor or None"),
    (dict(metadata={"answer": ["x"]}), "metadata key 'answer' has 1 values"),
    (dict(metadata={KEY: ["x", "y"]}), "both a tensor key and a metadata key"),
])
def test_validation_errors_name_the_key(kwargs, needle):
    base = dict(ids=["a", "b"], seqlens={KEY: [[2], [4]]}, data={KEY: torch.zeros(6, dtype=torch.long)}, metadata={})
    base.update(kwargs)
    with pytest.raises(BatchError) as e:
        SequenceBatch(**base)
    assert needle in str(e.value)


def test_microbatchspec_validation():
    assert MicroBatchSpec().n_mbs == 1
    with pytest.raises(BatchError, match="n_mbs"):
        MicroBatchSpec(n_mbs=0)
    with pytest.raises(BatchError, match="max_tokens_per_mb"):
        MicroBatchSpec(max_tokens_per_mb=0)


def test_meta_and_multidim_tensors():
    b = SequenceBatch(["a", "b"], {"h": [[2], [1]]}, {"h": torch.arange(12.0).view(3, 4)}, {"m": [{"k": [1]}, None]})
    m = b.meta()
    assert m.data == {"h": None} and m.seqlens == b.seqlens and m.metadata == b.metadata
    assert b.data["h"] is not None  # the source keeps its tensors
    assert b.select_ids(["b"]).data["h"].tolist() == [[8.0, 9.0, 10.0, 11.0]]


# ---- key and sample selection -------------------------------------------------------------------


def test_select_keys_and_ids():
    b = make_batch([[3], [2, 2], [1]])
    s = b.select_keys([KEY, "answer"])
    assert s.keys == {KEY, "answer"} and s.data[KEY] is b.data[KEY]
    with pytest.raises(BatchError, match="batch has no key 'logprob'; did you mean 'logprobs'"):
        b.select_keys(["logprob"])
    r = b.select_ids(["s2", "s0"])
    assert r.ids == ["s2", "s0"] and r.data[KEY].tolist() == [2000, 0, 0, 0]
    assert r.metadata["answer"] == ["a2", "a0"] and r.seqlens[KEY] == [[1], [3]]
    assert torch.equal(r.data["logprobs"], torch.cat([b.data["logprobs"][7:8], b.data["logprobs"][0:3]]))
    with pytest.raises(BatchError, match="sample id 'zz' is not in this batch"):
        b.select_ids(["zz"])
    with pytest.raises(BatchError, match="repeated ids"):
        b.select_ids(["s0", "s0"])
    assert len(b.select_ids([])) == 0


def test_remap_keys():
    b = make_batch([[2], [1]])
    r = b.remap_keys({KEY: "input_ids", "answer": "ref"})
    assert r.keys == {"input_ids", "logprobs", "rewards", "ref"} and torch.equal(r.data["input_ids"], b.data[KEY])
    with pytest.raises(BatchError, match="would appear twice"):
        b.remap_keys({KEY: "logprobs"})
    with pytest.raises(BatchError, match="no key 'nope'"):
        b.remap_keys({"nope": "x"})
    assert b.remap_keys({KEY: "logprobs", "logprobs": KEY}).data[KEY].dtype == torch.float32  # swap is fine


def test_update_merges_keys_in_place():
    b = make_batch([[2], [3]], with_logp=False)
    other = SequenceBatch(["s1", "s0"], {"values": [[3], [2]]}, {"values": torch.arange(5.0)}, {"answer": ["x", "y"]})
    out = b.update_(other)
    assert out is b and b.keys == {KEY, "values", "answer"}
    assert b.data["values"].tolist() == [3.0, 4.0, 0.0, 1.0, 2.0]  # reordered to b's ids
    assert b.metadata["answer"] == ["y", "x"]  # replaced, like dict.update
    with pytest.raises(BatchError, match="different samples"):
        b.update_(make_batch([[1]], with_logp=False, prefix="t"))


# ---- unpack / gather ---------------------------------------------------------------------------


def test_unpack_gather_roundtrip_and_errors():
    b = make_batch([[3, 1], [2], [1, 1]])
    parts = b.unpack()
    assert [p.ids for p in parts] == [["s0"], ["s1"], ["s2"]] and parts[1].data[KEY].tolist() == [1000, 1000]
    assert SequenceBatch.gather(parts).equal(b)
    assert SequenceBatch.gather([p.meta() for p in parts]).equal(b.meta())
    with pytest.raises(BatchError, match="empty list"):
        SequenceBatch.gather([])
    with pytest.raises(BatchError, match="duplicate sample id 's0'"):
        SequenceBatch.gather([parts[0], parts[0]])
    with pytest.raises(BatchError, match=r"batch 1 has different keys than batch 0 \(differing keys: \['logprobs'\]\)"):
        SequenceBatch.gather([parts[0], parts[1].select_keys([KEY, "rewards", "answer"])])
    with pytest.raises(BatchError, match="key '.*' has a tensor in some batches and none"):
        SequenceBatch.gather([parts[0], parts[1].meta()])
    half = parts[1].remap_keys({})
    half.data["logprobs"] = half.data["logprobs"].double()
    with pytest.raises(BatchError, match="key 'logprobs' mixes torch.float32"):
        SequenceBatch.gather([parts[0], half])


# ---- split_balanced / micro_batches --------------------------------------------------------------


def test_split_balanced_example():
    b = make_batch([[9], [1], [1], [1], [8], [2]], with_logp=False)
    parts, idx = b.split_balanced_with_index(2)
    assert idx == [[0, 1, 2], [3, 4, 5]]  # 11 vs 11 tokens
    assert [p.ids for p in parts] == [["s0", "s1", "s2"], ["s3", "s4", "s5"]]
    assert [p.total_tokens() for p in parts] == [11, 11]
    assert b.split_balanced(2)[0].equal(parts[0])  # deterministic
    assert SequenceBatch.gather(parts).select_ids(b.ids).equal(b)
    with pytest.raises(BatchError, match="cannot split 6 samples into 7 non-empty parts"):
        b.split_balanced(7)
    with pytest.raises(BatchError, match="no tensor key 'tokens'"):
        b.split_balanced(2, key="tokens")


def test_micro_batches_examples():
    b = make_batch([[3], [4], [5], [6], [7], [8], [9]], with_logp=False)
    mbs, idx = b.micro_batches_with_index(MicroBatchSpec(n_mbs=1, max_tokens_per_mb=10))
    assert all(sum(b.sample_tokens()[i] for i in part) <= 10 for part in idx)
    assert sorted(i for p in idx for i in p) == list(range(7))
    big = b.micro_batches(MicroBatchSpec(max_tokens_per_mb=4))  # 3+4 > 4 and the rest exceed it: one each
    assert [m.ids for m in big] == [[i] for i in b.ids]
    # the budget counts padded tokens (sequences x longest): 3 and 4 together cost 2 x 4 = 8 > 7
    assert [len(m) for m in b.micro_batches(MicroBatchSpec(max_tokens_per_mb=7))] == [1] * 7
    assert [len(m) for m in b.micro_batches(MicroBatchSpec(max_tokens_per_mb=8))][0] == 2
    assert len(b.micro_batches(MicroBatchSpec(n_mbs=3))) == 3
    assert len(b.micro_batches(MicroBatchSpec(n_mbs=100))) == 7
    assert len(b.micro_batches(MicroBatchSpec(n_mbs=5, max_tokens_per_mb=1000))) == 5
    assert b.select_ids([]).micro_batches(MicroBatchSpec(2)) == []


group_lists = st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=4), min_size=1, max_size=30)
hyp = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@hyp
@given(groups=group_lists, n=st.integers(1, 8))
def test_split_balanced_properties(groups, n):
    b = make_batch(groups)
    if len(b) < n:
        with pytest.raises(BatchError):
            b.split_balanced(n)
        return
    parts, idx = b.split_balanced_with_index(n)
    assert len(parts) == n and all(len(p) > 0 for p in parts)
    assert sorted(i for p in idx for i in p) == list(range(len(b)))  # a partition
    assert all(p == sorted(p) for p in idx)  # stable order inside parts
    for part, positions in zip(parts, idx):
        assert part.ids == [b.ids[i] for i in positions]
        for p, i in enumerate(positions):  # samples are whole and their tensors follow them
            assert part.seqlens[KEY][p] == b.seqlens[KEY][i]
            assert all(torch.equal(x, y) for x, y in zip(part.sequences("logprobs", p), b.sequences("logprobs", i)))
    loads = [p.total_tokens() for p in parts]
    assert max(loads) - min(loads) <= max(b.sample_tokens())  # LPT balance bound
    again, idx2 = b.split_balanced_with_index(n)
    assert idx2 == idx
    assert SequenceBatch.gather(parts).select_ids(b.ids).equal(b)


@hyp
@given(groups=group_lists, n_mbs=st.integers(1, 6), budget=st.one_of(st.none(), st.integers(1, 80)))
def test_micro_batches_properties(groups, n_mbs, budget):
    b = make_batch(groups)
    mbs, idx = b.micro_batches_with_index(MicroBatchSpec(n_mbs=n_mbs, max_tokens_per_mb=budget))
    tokens = b.sample_tokens()
    assert sorted(i for p in idx for i in p) == list(range(len(b)))  # nothing dropped or duplicated
    assert all(p and p == sorted(p) for p in idx)
    assert len(mbs) >= min(n_mbs, len(b))
    if budget is None:
        assert len(mbs) == min(n_mbs, len(b))
    else:
        for p in idx:
            assert len(p) == 1 or sum(tokens[i] for i in p) <= budget
    assert SequenceBatch.gather(mbs).select_ids(b.ids).equal(b)


# ---- wire format -------------------------------------------------------------------------------


def _only_plain_and_tensors(obj) -> bool:
    if obj is None or isinstance(obj, (bool, int, float, str, bytes, torch.Tensor)):
        return True
    if isinstance(obj, (list, tuple)):
        return all(_only_plain_and_tensors(x) for x in obj)
    if isinstance(obj, dict):
        return all(isinstance(k, str) and _only_plain_and_tensors(v) for k, v in obj.items())
    return False


@hyp
@given(groups=group_lists)
def test_wire_roundtrip_through_codec(groups):
    codec = pytest.importorskip("realflow.comm.codec")
    b = make_batch(groups)
    b.data["half"] = torch.ones(b.total_tokens(), dtype=torch.bfloat16)
    b.seqlens["half"] = b.seqlens[KEY]
    b = SequenceBatch(b.ids, b.seqlens, b.data, {"answer": b.metadata["answer"], "info": [{"k": [i, 0.5]} for i in range(len(b))]})
    wire = b.to_wire()
    assert _only_plain_and_tensors(wire)
    back = SequenceBatch.from_wire(codec.decode(codec.encode(wire)))
    assert back.equal(b) and back.data["half"].dtype == torch.bfloat16
    meta = SequenceBatch.from_wire(codec.decode(codec.encode(b.meta().to_wire())))
    assert meta.equal(b.meta())


def test_wire_rejects_non_plain_metadata_and_bad_dicts():
    b = SequenceBatch(["a"], {}, {}, {"obj": [object()]})
    with pytest.raises(BatchError, match="metadata 'obj': value of type object"):
        b.to_wire()
    with pytest.raises(BatchError, match="dict keys must be str"):
        SequenceBatch(["a"], {}, {}, {"m": [{1: 2}]}).to_wire()
    with pytest.raises(BatchError, match="expected a dict with ids/seqlens/data/metadata"):
        SequenceBatch.from_wire({"ids": []})
    with pytest.raises(BatchError, match="tensor dim 0"):
        SequenceBatch.from_wire({"ids": ["a"], "seqlens": {KEY: [[2]]}, "data": {KEY: torch.zeros(3)}, "metadata": {}})


def test_meta_wire_matches_meta_to_wire():
    b = SequenceBatch.from_samples(["a", "b"], {"x": [torch.arange(3), [torch.arange(2), torch.arange(1)]]},
                                   metadata={"answer": ["1", "2"]})
    assert b.meta_wire() == b.meta().to_wire()
    with pytest.raises(BatchError, match="not a plain msgpack type"):
        SequenceBatch.from_samples(["a"], {"x": [torch.arange(3)]}, metadata={"m": [torch.zeros(1)]}).meta_wire()


def test_micro_batches_group_similar_lengths_within_the_padded_budget():
    """Long-tailed lengths: micro-batches of similar lengths compute far fewer padded tokens
    than one block, every micro-batch within the budget, every sample exactly once."""
    import random

    from realflow.api.padded_partition import padded_cost, padded_partition

    rng = random.Random(0)
    # a sample: one sequence, or a group of answers to one problem (similar lengths)
    bases = [rng.choice([12, 14, 16, 20, 24, 30, 45, 60, 90]) for _ in range(64)]
    groups = [[base + rng.randint(0, 4) for _ in range(rng.choice([1, 8]))] for base in bases]
    lens = [list(g) for g in groups]
    budget = 8192
    parts = padded_partition(lens, 1, budget)
    assert sorted(i for p in parts for i in p) == list(range(64))
    assert all(padded_cost(lens, p) <= budget or len(p) == 1 for p in parts)
    assert all(p == sorted(p) for p in parts) and [p[0] for p in parts] == sorted(p[0] for p in parts)
    one_block = padded_cost(lens, range(64))
    assert sum(padded_cost(lens, p) for p in parts) < 0.7 * one_block
    assert len(padded_partition(lens, 40, budget)) >= 40  # n_mbs is a minimum
    b = make_batch(groups, with_logp=False)
    mbs = b.micro_batches(MicroBatchSpec(max_tokens_per_mb=budget))
    assert SequenceBatch.gather(mbs).select_ids(b.ids).equal(b)
