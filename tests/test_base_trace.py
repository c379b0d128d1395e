"""Tracer writes valid Chrome/Perfetto trace JSON; per-process files merge into one."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from realflow.base.trace import Tracer, iter_spans, load_trace, merge_traces

pytestmark = pytest.mark.timeout(60)

CHILD = r"""
import sys, time
from realflow.base.trace import Tracer
t = Tracer(sys.argv[1], path=sys.argv[2])
with t.span("step", i=0):
    with t.span("inner", obj=object()):
        time.sleep(0.02)
t.instant("weights_updated", version=1)
t.counter("buffer", size=3)
t.save()
"""


def _check_event(ev):
    assert isinstance(ev["name"], str) and ev["ph"] in "XiCM"
    assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int)
    if ev["ph"] != "M":
        assert isinstance(ev["ts"], (int, float))
    if ev["ph"] == "X":
        assert ev["dur"] >= 0


def test_spans_nest_and_save_valid_json(tmp_path):
    t = Tracer("master", path=tmp_path / "m.json")
    with t.span("outer", step=1):
        with t.span("inner"):
            time.sleep(0.01)
    with pytest.raises(RuntimeError):
        with t.span("failing"):
            raise RuntimeError("x")
    doc = json.loads(t.save().read_text())
    events = doc["traceEvents"]
    for ev in events:
        _check_event(ev)
    assert {"name": "process_name", "ph": "M", "pid": t.pid, "tid": 0, "args": {"name": "master"}} in events
    outer, = iter_spans(events, "outer")
    inner, = iter_spans(events, "inner")
    assert outer["args"] == {"step": 1}
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    assert inner["dur"] >= 10_000  # microseconds
    assert next(iter_spans(events, "failing"))["args"]["error"] == "RuntimeError"


def test_disabled_tracer_records_nothing_and_is_cheap():
    t = Tracer("w", enabled=False)
    n = 100_000
    t0 = time.perf_counter()
    for _ in range(n):
        with t.span("hot", i=1):
            pass
    per_span = (time.perf_counter() - t0) / n
    assert [ev["ph"] for ev in t.events] == ["M"]
    assert per_span < 5e-6, f"disabled span costs {per_span * 1e9:.0f} ns"


def test_merge_traces_of_processes(tmp_path):
    files = [tmp_path / f"w{i}.json" for i in range(2)]
    for i, f in enumerate(files):
        subprocess.run([sys.executable, "-c", CHILD, f"worker{i}", str(f)], check=True, timeout=30)
    # a third file that reuses worker0's pid (as a process on another host could)
    clash = load_trace(files[0])
    (tmp_path / "clash.json").write_text(json.dumps(clash))  # bare-array form is accepted too
    out = merge_traces([*files, tmp_path / "clash.json"], tmp_path / "merged.json")
    events = json.loads(out.read_text())["traceEvents"]
    for ev in events:
        _check_event(ev)
    names = {ev["pid"]: ev["args"]["name"] for ev in events if ev["name"] == "process_name"}
    assert sorted(names.values()) == ["worker0", "worker0", "worker1"] and len(names) == 3
    assert len(list(iter_spans(events, "step"))) == 3
    spans = {ev["pid"]: ev for ev in iter_spans(events, "inner")}
    assert all(isinstance(ev["args"]["obj"], str) for ev in spans.values())  # non-JSON args stringified
    # wall-clock timestamps: the two real processes ran one after the other
    s0, s1 = (next(ev for ev in iter_spans(events, "step") if names[ev["pid"]] == f"worker{i}") for i in (0, 1))
    assert s0["ts"] + s0["dur"] <= s1["ts"]


def test_bad_trace_file_is_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not a JSON trace"):
        merge_traces([bad], tmp_path / "out.json")
    with pytest.raises(ValueError, match="no path given"):
        Tracer("x").save()
