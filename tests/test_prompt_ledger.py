"""The prompt ledger's invariant ``next_index == trained + pending + failed`` holds whatever order
the trainer's "trained" reports and the rollout workers' /done reports arrive in."""
from realflow.rollout.prompt_ledger import PromptLedger


def _check(ledger: PromptLedger, trained: int) -> None:
    s = ledger.state()
    assert s["next_index"] == trained + len(s["pending"]) + s["failed"], s


def test_trained_after_done_leaves_pending():
    ledger = PromptLedger()
    a, b, c = ledger.hand_out(), ledger.hand_out(), ledger.hand_out()
    ledger.finished(a, "x/e0", ok=True)
    ledger.finished(b, "y/e0", ok=False)
    ledger.trained(["x/e0"])
    assert ledger.state() == {"next_index": 3, "pending": [c], "failed": 1}
    _check(ledger, trained=1)


def test_trained_before_done_is_not_pending_again():
    # the rollout worker pushes to the trainer before its /done: a fast trainer reports first
    ledger = PromptLedger()
    a, b = ledger.hand_out(), ledger.hand_out()
    ledger.trained(["x/e0"])
    ledger.finished(a, "x/e0", ok=True)
    assert ledger.state()["pending"] == [b]
    _check(ledger, trained=1)


def test_resume_hands_out_pending_first():
    ledger = PromptLedger(next_index=10, redo=[7, 3], failed=2)
    assert [ledger.hand_out(), ledger.hand_out(), ledger.hand_out()] == [3, 7, 10]
    _check(ledger, trained=10 - 2 - 2)  # ten handed out before: two failed, two untrained
