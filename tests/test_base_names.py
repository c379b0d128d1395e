"""Key layout: scoped by experiment and trial, validated, no secrets."""
from __future__ import annotations

import pytest

from realflow.base import names
from realflow.base.name_resolve import NameResolveConfig, NameResolveError, in_subtree, make_name_resolver


def test_keys_are_scoped_by_experiment_and_trial():
    a = names.worker_address("exp", "t0", "model", 3)
    assert a == "realflow/exp/t0/workers/model/3"
    assert in_subtree(a, names.worker_root("exp", "t0", "model"))
    assert in_subtree(a, names.trial_root("exp", "t0"))
    assert not in_subtree(a, names.trial_root("exp", "t"))  # 't' is not a prefix of 't0'
    assert names.worker_address("exp", "t1", "model", 3) != a
    w3 = names.model_worker_name(3)
    assert w3 == "model_worker/3"
    keys = [names.master_address("e", "t"), names.heartbeat_address("e", "t"), names.heartbeat_address("e", "t", w3),
            names.distributed_address("e", "t"), names.distributed_address("e", "t", "actor_tp0"),
            names.gen_server_address("e", "t", 0), names.rollout_controller_address("e", "t"),
            names.worker_status("e", "t", w3)]
    assert len(set(keys)) == len(keys)
    for key in keys:
        assert in_subtree(key, names.trial_root("e", "t")), key
    assert names.heartbeat_address("e", "t", w3) == "realflow/e/t/heartbeat/workers/model_worker/3"


def test_clear_one_trial_leaves_others(tmp_path):
    r = make_name_resolver(NameResolveConfig(type="file", root=str(tmp_path)))
    r.add(names.worker_address("exp", "t0", "model", 0), "tcp://127.0.0.1:1")
    r.add(names.worker_address("exp", "t1", "model", 0), "tcp://127.0.0.1:2")
    assert r.clear_subtree(names.trial_root("exp", "t0")) == 1
    assert r.find_subtree(names.trial_root("exp", "t1")) == ["realflow/exp/t1/workers/model/0"]
    r.close()


@pytest.mark.parametrize("call, match", [
    (lambda: names.trial_root("my/exp", "t"), "experiment name 'my/exp' must not contain '/'"),
    (lambda: names.trial_root("exp", ""), "trial name must not be empty"),
    (lambda: names.worker_address("e", "t", "model", -1), "worker index must be an int >= 0"),
    (lambda: names.heartbeat_address("e", "t", "bad name"), "may only contain"),
    (lambda: names.model_worker_name(-2), "model worker index must be an int >= 0"),
    (lambda: names.distributed_address("e", "t", "secret_group"), "looks like a secret"),
])
def test_bad_components_are_named(call, match):
    with pytest.raises(NameResolveError, match=match):
        call()
