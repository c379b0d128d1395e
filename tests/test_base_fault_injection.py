"""The test-only fault hook (realflow.base.fault_injection): its grammar, its one-line
errors, and, in real child processes, that it kills at the k-th event and only once per run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from realflow.base import fault_injection as fi

EXPECTED = "expected <process>@<event>=<k>[:<signal>]"


@pytest.mark.parametrize("text, process, event, k, sig", [
    ("model_worker/0@train_step=5", "model_worker/0", "train_step", 5, signal.SIGKILL),
    ("master@step=3:SIGSTOP", "master", "step", 3, signal.SIGSTOP),
    (" rollout_worker/12@rollout=20:term ", "rollout_worker/12", "rollout", 20, signal.SIGTERM),
    ("gen_server/1@generate=1:KILL", "gen_server/1", "generate", 1, signal.SIGKILL),
    ("master@finished=1", "master", "finished", 1, signal.SIGKILL),
])
def test_parses_the_grammar(text, process, event, k, sig):
    f = fi.parse(text)
    assert (f.process, f.event, f.k, f.signal) == (process, event, k, sig)


@pytest.mark.parametrize("text, why", [
    ("model_worker/0", "it does not match"),
    ("model_worker/0@train_step", "it does not match"),
    ("model_worker/0@train_step=x", "it does not match"),
    ("model_worker/0@train_step=-1", "it does not match"),
    ("model_worker/0@train_step=5:", "it does not match"),
    ("model_worker/0@trian_step=5", "unknown event 'trian_step' (events: finished, generate, rollout, step, "
                                    "train_step)"),
    ("master@train_step=5", "event 'train_step' happens in model_worker processes, not in master"),
    ("model_worker/0@train_step=0", "k=0 must be >= 1"),
    ("model_worker/0@train_step=5:SIGNOPE", "unknown signal 'SIGNOPE'"),
])
def test_a_bad_value_is_one_line_naming_the_variable_and_the_grammar(text, why):
    with pytest.raises(ValueError) as e:
        fi.parse(text)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"REALFLOW_FAULT_INJECT={text!r}: {EXPECTED}") and msg.endswith(why), msg


def test_arms_only_the_named_process_and_only_until_the_run_is_marked(tmp_path):
    env = {fi.ENV: "model_worker/1@train_step=2", "REALFLOW_SECRET_FILE": str(tmp_path / ".secret")}
    assert fi.arm({}) is None and fi.arm({**env, "REALFLOW_ROLE": "model_worker/0"}) is None
    assert fi.arm({**env, "REALFLOW_ROLE": "model_worker/1"}).run_dir == str(tmp_path)
    with pytest.raises(ValueError, match=r"^REALFLOW_FAULT_INJECT='model_worker/1@train_step=2': model_worker/1 "
                                         r"has no REALFLOW_SECRET_FILE"):
        fi.arm({fi.ENV: env[fi.ENV], "REALFLOW_ROLE": "model_worker/1"})
    (tmp_path / "logs").mkdir()
    (tmp_path / fi.MARKER).write_text("{}")
    assert fi.arm({**env, "REALFLOW_ROLE": "model_worker/1"}) is None  # fired in an earlier attempt
    assert fi._FAULT is None  # this process (the test run) has nothing armed: fault_point returns at once


_CHILD = textwrap.dedent("""
    from realflow.base.fault_injection import fault_point
    for i in range(1, 6):
        fault_point("step")       # not the event asked for: never counts
        print(i, flush=True)
        fault_point("train_step")
    print("done", flush=True)
""")


def _child(run_dir, spec: str) -> subprocess.CompletedProcess:
    env = {**os.environ, fi.ENV: spec, "REALFLOW_ROLE": "model_worker/0",
           "REALFLOW_SECRET_FILE": str(run_dir / ".secret")}
    return subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_real_process_dies_at_the_kth_event_and_its_relaunch_does_not(tmp_path, sig):
    spec = f"model_worker/0@train_step=3:{sig.name}"
    first = _child(tmp_path, spec)
    assert first.returncode == -sig and first.stdout.split() == ["1", "2", "3"], (first.stdout, first.stderr)
    assert f"fault injection (REALFLOW_FAULT_INJECT={spec}): model_worker/0 sends itself {sig.name} " \
           "at train_step 3" in first.stderr
    mark = fi.fired(str(tmp_path))
    assert mark["process"] == "model_worker/0" and mark["k"] == 3 and mark["signal"] == sig.name
    assert json.loads((tmp_path / "logs" / "fault_injected.json").read_text())["time"] == mark["time"]
    again = _child(tmp_path, spec)  # the relaunched process of the same run
    assert again.returncode == 0 and again.stdout.split()[-1] == "done", again.stderr
    assert fi.fired(str(tmp_path / "elsewhere")) is None
