"""``realflow calibrate`` and the device profiles: a quick calibration of this machine writes a
profile that loads and holds plausible CPU numbers; the shipped published GPU profiles load and
are ordered as their datasheets; a bad profile is refused with an error naming what is wrong."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from realflow.apps import calibrate as calibrate_app
from realflow.planner.calibrate import CalibrationError, fit_line
from realflow.planner.profile import (DeviceProfile, LinkProfile, ProfileError, load_profile,
                                             profile_from_dict, shipped_profiles)

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
           PYTHONWARNINGS="ignore")


@pytest.mark.timeout(300)
def test_quick_calibration_through_the_cli(tmp_path):
    out = tmp_path / "sub" / "prof.json"
    # ~70 s on an idle 2-core host (the engine's costs on 2 processes); the limit only catches a hang
    r = subprocess.run([sys.executable, "-m", "realflow.apps.main", "calibrate", "--quick", "--out", str(out)],
                       cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout + r.stderr
    assert str(out) in r.stdout and "matmul" in r.stdout and "all-reduce" in r.stdout
    p = load_profile(str(out))
    assert p.source.startswith("measured: ") and "threads=1" in p.source and "torch " in p.source
    assert p.params_bytes == 4 and 2**28 < p.memory_bytes < 2**50  # fp32 CPU worker; MemTotal / world
    # rates: one CPU core in fp32, give or take a loaded machine
    assert 1e8 < p.matmul_flops < 1e13
    assert 1e7 < p.attention_flops < 1e13
    assert 1e8 < p.memory_bandwidth < 1e12
    assert 1e7 < p.host_bandwidth <= p.memory_bandwidth
    # fixed costs: measured directly (> 0) or fitted intercepts (clamped at 0), never absurd
    assert 0 < p.op_overhead_s < 1e-2
    for v in (p.matmul_overhead_s, p.attention_overhead_s, p.decode_layer_overhead_s):
        assert 0 <= v < 0.1
    for link in (p.intra_node, p.intra_node_all_gather, p.intra_node_p2p):
        assert isinstance(link, LinkProfile)
        assert link.bandwidth > 1e7 and 0 <= link.alpha_s < 0.1


def test_cli_reports_a_bad_world_without_writing(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert calibrate_app.main(["--world", "1", "--out", str(out)]) == 2
    assert "world=1" in capsys.readouterr().err and not out.exists()
    with pytest.raises(SystemExit) as e:
        calibrate_app.main(["--threads", "0"])
    assert e.value.code == 2


def test_link_failure_names_the_rank_and_the_stage():
    code = "from realflow.planner.calibrate import measure_links; measure_links(2, True, timeout_s=0.05)"
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=110)
    assert r.returncode != 0
    assert "CalibrationError: link measurement over 2 local processes failed" in r.stderr
    assert "rank 0 timed out after 0.05s in '" in r.stderr


def test_fit_line():
    x = [1e3, 1e5, 1e7]
    assert fit_line(x, [2e-6 + v / 1e9 for v in x], "t") == pytest.approx((2e-6, 1e-9), rel=1e-6)
    a, b = fit_line(x, [v / 1e9 - 5e-7 for v in x], "t")  # the intercept would be < 0: refit through 0
    assert a == 0.0 and b == pytest.approx(1e-9, rel=0.5)
    with pytest.raises(CalibrationError, match="matmul: time does not grow"):
        fit_line(x, [1e-3, 1e-4, 1e-5], "matmul")
    with pytest.raises(CalibrationError, match="memcpy: need >= 2 positive"):
        fit_line([1.0], [1.0], "memcpy")


def test_shipped_profiles_are_published_and_ordered():
    assert {"h100", "h200", "a100", "cpu-example"} <= set(shipped_profiles())
    h100, h200, a100 = (load_profile(n) for n in ("h100", "h200", "a100"))
    for p in (h100, h200, a100):
        assert p.source.startswith("published: ") and "datasheet" in p.source
        assert p.params_bytes == 2
        assert p.link("p2p") is p.intra_node and p.link("all_gather") is p.intra_node
    assert "assumed" in a100.source  # its sustained fractions; the Hopper ones were checked on an H200
    assert all("sustained rates checked on one H200" in p.source for p in (h100, h200))
    assert h200.memory_bytes > h100.memory_bytes >= a100.memory_bytes
    assert h100.matmul_flops > a100.matmul_flops and h200.matmul_flops == h100.matmul_flops
    assert h200.memory_bandwidth > h100.memory_bandwidth > a100.memory_bandwidth
    assert h100.intra_node.bandwidth > a100.intra_node.bandwidth
    assert h100.host_bandwidth > a100.host_bandwidth
    cpu = load_profile("cpu-example")
    assert cpu.source.startswith("measured: ") and cpu.params_bytes == 4
    assert cpu.intra_node_p2p is not None and cpu.link("p2p") is cpu.intra_node_p2p
    assert h100.matmul_flops > 100 * cpu.matmul_flops


def test_profile_round_trips_through_json():
    for name in ("h100", "cpu-example"):
        p = load_profile(name)
        assert profile_from_dict(json.loads(p.to_json())) == p
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        load_profile("h100").link("broadcast")


def _write(tmp_path: Path, **changes) -> str:
    d = asdict(load_profile("h100"))
    d.update(changes)
    for k in [k for k, v in changes.items() if v is _DROP]:
        del d[k]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    return str(path)


_DROP = object()


@pytest.mark.parametrize("changes, message", [
    ({"matmul_flops": _DROP}, r"missing field\(s\) \['matmul_flops'\]"),
    ({"matmul_flop": 1e12}, r"unknown field\(s\) \['matmul_flop'\]; known: \[.*'matmul_flops'"),
    ({"matmul_flops": -1.0}, r"matmul_flops=-1.0 must be a number > 0"),
    ({"op_overhead_s": -1e-6}, r"op_overhead_s=-1e-06 must be a number >= 0"),
    ({"memory_bytes": "80GB"}, r"memory_bytes='80GB' must be a number > 0"),
    ({"intra_node": {"alpha_s": 1e-6, "bandwidth": -5.0}}, r"intra_node: alpha_s must be >= 0 and bandwidth > 0"),
    ({"intra_node_p2p": {"alpha_s": 1e-6}}, r"intra_node_p2p must be \{alpha_s, bandwidth\}"),
    ({"name": ""}, r"name must be a non-empty string"),
])
def test_bad_profile_names_the_field(tmp_path, changes, message):
    with pytest.raises(ProfileError, match=message):
        load_profile(_write(tmp_path, **changes))


def test_bad_profile_names_and_files(tmp_path):
    with pytest.raises(ProfileError, match=r"no device profile 'h1000'; shipped: a100, cpu-example, h100, h200"):
        load_profile("h1000")
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(str(tmp_path / "none.json"))
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ProfileError, match="is not JSON"):
        load_profile(str(tmp_path / "x.json"))
    (tmp_path / "y.json").write_text("[1, 2]")
    with pytest.raises(ProfileError, match="must hold a JSON object"):
        load_profile(str(tmp_path / "y.json"))
    assert isinstance(profile_from_dict({k: v for k, v in asdict(load_profile("h100")).items()
                                         if k not in ("intra_node", "intra_node_p2p")}), DeviceProfile)


def test_fit_decode_separates_per_step_per_layer_and_per_sequence_costs():
    """Times made from known costs on the (depth, live sequences) grid the engine is measured on
    come back as those costs: what a step, a layer, a sequence and a call each add."""
    from parallel.overheads import DECODE_BATCHES, DECODE_STEPS, DEPTHS, fit_decode

    a, b, c, d, e, f = 2e-4, 5e-5, 3e-5, 4e-6, 1e-2, 2e-4
    dec = {(x, n): a + b * x + n * (c + d * x) for x in DEPTHS for n in DECODE_BATCHES}
    call = {(x, n): e + f * n for x in DEPTHS for n in DECODE_BATCHES}
    got = fit_decode(dec, call)
    assert got["decode_step_overhead_s"] == pytest.approx(a) and got["decode_layer_overhead_s"] == pytest.approx(b)
    assert got["decode_seq_s"] == pytest.approx(c) and got["decode_layer_seq_s"] == pytest.approx(d)
    assert got["generate_call_overhead_s"] == pytest.approx(e) and got["generate_seq_overhead_s"] == pytest.approx(f)
    assert len(DECODE_STEPS) == 2


def test_fit_costs_recovers_known_costs_and_resists_noise_at_the_largest_batch():
    """A layer costing 2 ms per micro-batch + 18 us per token, 5 ms per call + 3 us per token:
    recovered exactly, the layer's measured curve included; with the 2048-token times 5% high
    (this host's noise is in proportion to a timing), only the curve's last point moves, and
    the relative-error fit keeps the call's fixed cost within 2%."""
    from parallel.overheads import DEPTHS, TOKENS, fit_costs

    exact = {(d, n): 5e-3 + 3e-6 * n + d * (2e-3 + n * 1.8e-5) for d in DEPTHS for n in TOKENS}
    fit = fit_costs(exact)
    assert (fit["token_s"], fit["overhead_s"], fit["call_s"], fit["head_token_s"]) == pytest.approx(
        (1.8e-5, 2e-3, 5e-3, 3e-6), rel=1e-9)
    assert [n for n, _ in fit["curve"]] == list(TOKENS)
    assert [y for _, y in fit["curve"]] == pytest.approx([2e-3 + n * 1.8e-5 for n in TOKENS], rel=1e-9)
    noisy = {(d, n): t * (1.05 if n == max(TOKENS) else 1.0) for (d, n), t in exact.items()}
    got = fit_costs(noisy)
    assert got["overhead_s"] == pytest.approx(2e-3, rel=1e-9)
    assert [y for _, y in got["curve"][:-1]] == pytest.approx([y for _, y in fit["curve"][:-1]], rel=1e-9)
    assert got["call_s"] == pytest.approx(5e-3, rel=0.02)


def test_fit_costs_keeps_a_convex_layer_cost_as_measured():
    """A layer whose cost per token doubles past 1024 tokens (a tensor-parallel layer here: 10 us
    per token below, 16 above): the curve holds every measured point, so a 1536-token micro-batch
    is priced between them, where one line through all of them would miss it; a point that dips
    below the one before (noise) is lifted to it."""
    from parallel.overheads import DEPTHS, TOKENS, fit_costs
    from realflow.planner.profile import curve_at

    def layer(n: float) -> float:
        return 3e-3 + 1e-5 * min(n, 1024) + 2e-5 * max(n - 1024, 0)

    fit = fit_costs({(d, n): 4e-3 + d * layer(n) for d in DEPTHS for n in TOKENS})
    assert curve_at(fit["curve"], 1536) == pytest.approx(layer(1536), rel=1e-9)
    assert curve_at(fit["curve"], 4096) == pytest.approx(layer(4096), rel=1e-9)  # past the end: its last slope
    assert curve_at(fit["curve"], 0) == pytest.approx(fit["overhead_s"]) == pytest.approx(3e-3, rel=1e-9)
    line = fit["overhead_s"] + 1536 * fit["token_s"]
    assert abs(line - layer(1536)) / layer(1536) > 0.05  # what the line alone would have said
    dipped = fit_costs({(d, n): 4e-3 + d * (layer(n) * (0.5 if n == 1024 else 1.0)) for d in DEPTHS for n in TOKENS})
    ys = [y for _, y in dipped["curve"]]
    assert ys == sorted(ys) and ys[2] == pytest.approx(layer(512))


def test_the_cost_model_prices_a_micro_batch_on_the_measured_curve():
    """A profile with a measured tp=2 curve: a tp=2 train step's layer cost is the curve's value at
    its micro-batch size (interpolated); tp=1 keeps its own curve, and a profile without one its
    line."""
    import dataclasses

    from realflow.api.allocation import ParallelStrategy
    from realflow.planner.cluster import ClusterSpec
    from realflow.planner.cost import ModelFacts, Work, mfc_cost
    from realflow.planner.profile import curve_at

    base = load_profile("cpu-example")
    ref = base.layer_reference_params
    curve = ((32.0, 0.010), (512.0, 0.014), (1024.0, 0.020), (2048.0, 0.040))
    prof = dataclasses.replace(base, measured_tp=2.0, tp_layer_train_curve=curve, tp_layer_train_overhead_s=0.0097,
                               tp_layer_train_token_s=1e-5, tp_train_step_overhead_s=0.005)
    assert prof.layer_costs(2, True, 768) == pytest.approx((0.017 - 0.0097, 0.0097))
    assert base.layer_train_curve  # tp=1 keeps its own curve
    assert prof.layer_costs(1, True, 768) == pytest.approx(
        (curve_at(base.layer_train_curve, 768) - base.layer_train_overhead_s, base.layer_train_overhead_s))
    line = dataclasses.replace(prof, layer_train_curve=())  # a profile without curves: the line
    assert line.layer_costs(1, True, 768) == pytest.approx((base.layer_train_token_s * 768, base.layer_train_overhead_s))
    cluster = ClusterSpec(1, 2, prof, prof.intra_node)
    cfg = dict(num_hidden_layers=4, hidden_size=128, intermediate_size=352, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128)
    facts = ModelFacts.from_hf(cfg)
    c = mfc_cost(facts, ParallelStrategy(tp=2), [0, 1], Work("train", seqs=48, seq_len=16), cluster)
    scale = facts.layer_params / ref
    assert c.overhead == pytest.approx(4 * 0.0097)
    assert c.compute > 4 * (0.017 - 0.0097) * scale  # the layers' tokens, plus the LM head and attention


def test_a_call_at_the_measured_tp_pays_its_own_fixed_cost():
    """A train step at the tensor parallelism calibrate measured costs what was measured there
    (its loss and grad-norm collectives included), even where that came out 0; any other tp
    falls back to the tp=1 cost."""
    import dataclasses

    prof = dataclasses.replace(load_profile("cpu-example"), measured_tp=2.0, train_step_overhead_s=0.010,
                               tp_train_step_overhead_s=0.016, forward_overhead_s=0.001, tp_forward_overhead_s=0.0)
    assert prof.call_overhead(2, True) == 0.016
    assert prof.call_overhead(1, True) == prof.call_overhead(4, True) == 0.010
    assert prof.call_overhead(2, False) == 0.0 and prof.call_overhead(1, False) == 0.001
