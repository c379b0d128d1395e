"""Trajectories from an agent to the trainer: the batch they become, and the signed inbox that receives them."""
from __future__ import annotations

import time

import pytest
import torch
import zmq

from realflow.api.rollout import RolloutError, Trajectory, rollout_to_batch
from realflow.comm.auth import Signer, new_secret
from realflow.comm.codec import encode
from realflow.system.trajectory_inbox import TrajectoryInbox


def _traj(reward=1.0, versions=(3, 4)):
    return Trajectory.single_turn([5, 6, 7], [8, 9], [-0.5, -0.25], list(versions), reward, truncated=False)


def test_rollout_batch_aligns_behaviour_logprobs_and_versions_with_the_actions():
    b = rollout_to_batch("r1", [_traj(1.0), _traj(0.0, (4, 4))], version_admit=3, answer="42")
    assert b.ids == ["r1"] and b.seqlens["packed_input_ids"] == [[5, 5]]
    ids, pm, lp, ver = (b.data[k][:5] for k in ("packed_input_ids", "prompt_mask", "packed_logprobs",
                                                 "packed_versions"))
    assert ids.tolist() == [5, 6, 7, 8, 9] and pm.tolist() == [True, True, True, False, False]
    # entry t belongs to the action predicting token t + 1 (mfc.rl_batch's convention)
    assert lp.tolist() == [0.0, 0.0, -0.5, -0.25, 0.0]
    assert ver.tolist() == [-1, -1, 3, 4, -1]
    assert b.data["rewards"].tolist() == [1.0, 0.0]
    assert b.metadata == {"version_admit": [3], "version_oldest": [3], "version_newest": [4], "answer": ["42"]}


@pytest.mark.parametrize("bad, message", [
    (Trajectory([1, 2], [False, False], [0.0, 0.0], [-1, -1], 1.0), "no generated token"),
    (Trajectory([1, 2], [True, True], [0.0, 0.0], [1, 1], 1.0), "starts with a generated token"),
    (Trajectory([1, 2], [False, True], [0.0], [-1, 1], 1.0), "logprobs has 1 entries for 2 tokens"),
])
def test_malformed_trajectories_are_named(bad, message):
    with pytest.raises(RolloutError, match=message):
        rollout_to_batch("r9", [bad], version_admit=0)
    with pytest.raises(RolloutError, match="predates its admission"):
        rollout_to_batch("r9", [_traj(versions=(1, 2))], version_admit=2)


def test_inbox_takes_signed_rollouts_and_drops_forged_ones():
    secret = new_secret()
    inbox = TrajectoryInbox("model_worker/0", secret)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(inbox.address)
    try:
        good, forger = Signer(secret, "rollout_worker/0"), Signer(new_secret(), "rollout_worker/0")
        for i, signer in enumerate([good, forger, good]):
            wire = rollout_to_batch(f"r{i}", [_traj()], version_admit=3).to_wire()
            sock.send_multipart(signer.sign(encode(wire), "model_worker/0"))
        deadline = time.monotonic() + 10
        while (inbox.received < 2 or inbox.dropped < 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (inbox.received, inbox.dropped) == (2, 1)
        peeked = sorted(inbox.peek(), key=lambda r: r["id"])
        assert [(r["id"], r["admit"], r["oldest"], r["newest"]) for r in peeked] == [("r0", 3, 3, 4), ("r2", 3, 3, 4)]
        batch = inbox.take(["r2"])
        assert batch.ids == ["r2"] and torch.equal(batch.data["packed_input_ids"], torch.tensor([5, 6, 7, 8, 9]))
        assert [r["id"] for r in inbox.peek()] == ["r0"]
        with pytest.raises(KeyError, match="not in the inbox"):
            inbox.take(["r2"])
    finally:
        sock.close(0)
        inbox.close()
