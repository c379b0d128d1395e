"""The per-worker sample store: chunk fast path, mixed reads, overwrite, release, staging."""
import pytest
import torch

from realflow.api.batch import SequenceBatch
from realflow.system.data_manager import DataManager


def _batch(ids, key, base=0, metadata=None):
    return SequenceBatch.from_samples(
        ids, {key: [torch.arange(base + i, base + i + 1 + i % 3) for i in range(len(ids))]}, metadata)


@pytest.fixture
def dm():
    m = DataManager("model_worker/0", shm_prefix="rftest_dm")
    yield m
    m.close()


def test_whole_chunk_in_order_is_the_stored_tensor(dm):
    b = _batch(["a", "b", "c"], "x", metadata={"answer": [1, 2, 3]})
    dm.put(b)
    got = dm.get(["a", "b", "c"], ["x", "answer"])
    assert got.data["x"].data_ptr() == b.data["x"].data_ptr()  # no copy on the fast path
    assert got.equal(b)


def test_reorder_subset_and_mixed_chunks_match_per_sample_reference(dm):
    b1 = _batch(["a", "b", "c"], "x")
    b2 = _batch(["c", "a", "b"], "y", base=100)
    dm.put(b1)
    dm.put(b2)
    got = dm.get(["b", "a"], ["y", "x"])
    assert got.ids == ["b", "a"]
    assert torch.equal(got.sequences("x", 0)[0], b1.sequences("x", 1)[0])
    assert torch.equal(got.sequences("y", 1)[0], b2.sequences("y", 1)[0])
    # a sample whose keys come from different chunks than its neighbour's
    dm.put(_batch(["a"], "x", base=50))
    got = dm.get(["a", "b"], ["x", "y"])
    assert got.sequences("x", 0)[0].tolist() == [50]
    assert torch.equal(got.sequences("x", 1)[0], b1.sequences("x", 1)[0])


def test_overwrite_and_drop_release_chunks(dm):
    dm.put(_batch(["a", "b"], "x"))
    dm.put(_batch(["a", "b"], "x", base=7))  # replaces every entry of the first chunk
    assert dm.n_chunks == 1
    assert dm.get(["a"], ["x"]).data["x"].tolist() == [7]
    dm.put(_batch(["a", "b"], "y"))
    assert dm.drop(["a", "b", "zz"]) == 2
    assert dm.n_chunks == 0 and len(dm) == 0


def test_missing_sample_or_key_names_worker(dm):
    dm.put(_batch(["a"], "x"))
    with pytest.raises(KeyError, match="model_worker/0 holds no sample 'q'"):
        dm.get(["q"], ["x"])
    with pytest.raises(KeyError, match=r"without keys \['y'\]"):
        dm.get(["a"], ["x", "y"])


def test_stage_and_receive_round_trip(dm):
    other = DataManager("model_worker/1", shm_prefix="rftest_dm")
    try:
        b = _batch(["a", "b"], "x", metadata={"answer": ["1", "2"]})
        dm.put(b)
        other.receive(dm.stage(["b", "a"], ["x", "answer"]))
        got = other.get(["a", "b"], ["x", "answer"])
        assert got.equal(b)
    finally:
        other.close()
