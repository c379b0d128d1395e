"""Parameter reallocation between layouts: bit-exact on real megatron GPTModel parameters.

One 8-rank gloo group (parallel.testing.run_cases) runs every multi-process case:

* shard spec == real ``build_gpt_model`` parameters (names, shapes) for 12 layouts x
  {tied, untied embeddings}, and == hf_io's ``tp_shard`` of the padded full tensor;
* every pair of the 12 layouts {t1p1,t2p1,t1p2,t2p2,t4p1,t1p4} x {d1,d2} (source on
  the first ranks, destination on the last ranks: disjoint, overlapping or
  identical worker sets), with ranks 0-3 and 4-7 posing as two hosts so local
  copies, shared memory and point-to-point all run: ``torch.equal`` to the
  reference shards (vocab padding = 0);
* same-host pairs on one real host, and A -> B -> A returns identical tensors;
* eta blending equals ``eta*src + (1-eta)*dst`` bitwise;
* an HF checkpoint loaded whole (t1p1) then reallocated equals hf_io full tensors
  sharded with ``tp_shard`` in every layout;
* incompatible models / a missing module / an offloaded destination raise the same
  error on every member before anything moves, and the group keeps working;
* offload/reload of a GPTModel stage releases storage and restores it bitwise.

The same group's last case checks that a rank that never calls reallocate is named
by the others after the timeout (a plan over ranks 0-2; the rest are not members).
"""
from __future__ import annotations

import os
import re

import pytest
import torch

from parallel.testing import run_cases
from realflow.api.layout import Layout

MODULE = __name__.rsplit(".", 1)[-1]
WORLD = 8
TINY = dict(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
STRATS = ["t1p1", "t2p1", "t1p2", "t2p2", "t4p1", "t1p4"]
LAYOUTS = [f"{s}d{d}" for s in STRATS for d in (1, 2)]
FAKE_HOSTS = ["hostA"] * 4 + ["hostB"] * 4


# --------------------------------------------------------------------------- helpers (run in ranks)


def _cfg(tied: bool = True):
    import transformers as tf

    return tf.Qwen2Config(**TINY, tie_word_embeddings=tied)


def _strategy(name: str):
    from parallel.groups import ParallelStrategy

    d = dict(re.findall(r"([dtp])(\d+)", name))
    return ParallelStrategy(int(d.get("d", 1)), int(d.get("t", 1)), int(d.get("p", 1)))


def _layout(name: str, where: str):

    s = _strategy(name)
    n = s.world_size
    ranks = list(range(n)) if where == "head" else list(range(WORLD - n, WORLD))
    return Layout(tuple(ranks), s)


def _full(ctx, tied: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic unpadded full tensors (same on every rank)."""
    key = f"full:{tied}:{seed}"
    if key not in ctx.cache:
        from parallel.hf_io import param_table
        from parallel.model_config import hf_arch

        cfg = _cfg(tied)
        g = torch.Generator().manual_seed(seed)
        ctx.cache[key] = {e.mcore_name: torch.randn(e.mcore_shape, generator=g)
                          for e in param_table(cfg, hf_arch(cfg))}
    return ctx.cache[key]


def _model(ctx, layout_name: str, where: str, slot: str, tied: bool = True):
    """(GPTModel stage or None, Layout); groups/models made in the same order on every rank."""
    key = f"model:{layout_name}:{where}:{slot}:{tied}"
    if key not in ctx.cache:
        from parallel.groups import build_model_groups
        from parallel.model import build_gpt_model

        lay = _layout(layout_name, where)
        gkey = f"groups:{lay}"
        if gkey not in ctx.cache:
            ctx.cache[gkey] = build_model_groups(list(lay.workers), lay.strategy)
        groups = ctx.cache[gkey]
        torch.manual_seed(0)
        model = build_gpt_model(_cfg(tied), groups)[0] if groups.is_member else None
        ctx.cache[key] = (model, lay)
    return ctx.cache[key]


def _params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def _fill_reference(model, lay, tied=True, ctx=None, seed=0) -> None:
    from parallel.realloc import reference_shard, shard_spec

    full = _full(ctx, tied, seed)
    params = _params(model)
    with torch.no_grad():
        for n, s in shard_spec(_cfg(tied), lay)[torch.distributed.get_rank()].items():
            params[s.local_name].copy_(reference_shard(s, full[n]))


def _scramble(model, value: float = 13.0) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def _check_equal(model, lay, full, what: str) -> None:
    from parallel.realloc import reference_shard, shard_spec

    params = _params(model)
    spec = shard_spec(_cfg(), lay)[torch.distributed.get_rank()]
    for n, s in spec.items():
        want = reference_shard(s, full[n])
        got = params[s.local_name]
        assert torch.equal(got, want), f"{what}: {s.local_name} differs (max {float((got - want).abs().max())})"


def _run_pair(ctx, a: str, a_where: str, b: str, b_where: str, hosts, back: bool = False) -> dict:
    from parallel.realloc import plan_reallocation, prepare_reallocation, reallocate

    src_model, la = _model(ctx, a, a_where, "a")
    dst_model, lb = _model(ctx, b, b_where, "b")
    me = torch.distributed.get_rank()
    if src_model is not None and not ctx.cache.get(f"filled:{la}"):
        _fill_reference(src_model, la, ctx=ctx)
        ctx.cache[f"filled:{la}"] = True
    if dst_model is not None:
        _scramble(dst_model)
    plan = plan_reallocation(_cfg(), la, lb, torch.float32, hosts=hosts)
    res = prepare_reallocation(plan, timeout=60)
    stats = reallocate(plan, res, src_model, dst_model, timeout=60)
    res.close()
    if dst_model is not None:
        _check_equal(dst_model, lb, _full(ctx), f"{la} -> {lb}")
    if back:  # B -> A into the (scrambled) source model: A -> B -> A is the identity
        plan2 = plan_reallocation(_cfg(), lb, la, torch.float32, hosts=hosts)
        res2 = prepare_reallocation(plan2, timeout=60)
        if src_model is not None:
            _scramble(src_model, -7.0)
        reallocate(plan2, res2, dst_model, src_model, timeout=60)
        res2.close()
        if src_model is not None:
            _check_equal(src_model, la, _full(ctx), f"{la} -> {lb} -> back")
    return {k: v for k, v in stats.items() if k != "seconds"} if me in plan.members else {}


# --------------------------------------------------------------------------- cases


def case_spec_matches_models(ctx):
    from parallel.hf_io import local_param_table, param_table, tp_shard
    from parallel.model_config import hf_arch
    from parallel.realloc import reference_shard, shard_spec

    me = ctx.rank
    checked = 0
    for tied in (True, False):
        cfg = _cfg(tied)
        full = _full(ctx, tied)
        for name in LAYOUTS:
            model, lay = _model(ctx, name, "head", "a", tied)
            if model is None:
                continue
            spec = shard_spec(cfg, lay)[me]
            params = _params(model)
            got = {n: tuple(p.shape) for n, p in params.items()}
            want = {s.local_name: s.local_shape for s in spec.values()}
            assert got == want, f"{name} tied={tied} rank {me}: model {got} != spec {want}"
            # pieces agree with hf_io's tp_shard of the padded full tensor
            arch = hf_arch(cfg, tp_size=lay.strategy.tp)
            _, tp_rank, _ = lay.coords(me)
            by_entry = {e.mcore_name: (e, n) for e, n in local_param_table(model, param_table(cfg, arch))
                        # hf_io quirk (reported): with UNTIED embeddings it also maps the embedding
                        # entry onto the last stage's output_layer.weight
                        if tied or not (e.kind == "vocab" and n != e.mcore_name)}
            assert set(by_entry) == set(spec), f"{name}: local_param_table {sorted(by_entry)} != spec"
            for n, s in spec.items():
                e, local = by_entry[n]
                assert local == s.local_name
                f = full[n]
                if e.kind == "vocab":
                    f = torch.cat([f, f.new_zeros(arch.padded_vocab_size - f.shape[0], *f.shape[1:])])
                ref = tp_shard(e, f, tp_rank, lay.strategy.tp)
                assert torch.equal(reference_shard(s, full[n]), ref), f"{name} {n}: spec != tp_shard"
                checked += 1
    return {"checked": checked}


def case_plan_properties(ctx):
    """Pure plan facts: load spread over dp replicas, local preferred, deterministic, cheap."""
    import time

    from parallel.realloc import plan_reallocation
    from parallel.realloc.plan import LOCAL, P2P, SHM

    cfg = _cfg()
    # d2 on [0,1] -> d2 on [6,7], one host: each destination pulls from both replicas.
    p = plan_reallocation(cfg, _layout("t1p1d2", "head"), _layout("t1p1d2", "tail"))
    for d in (6, 7):
        sent = {r: sum(p.copy_bytes(c) for c in p.copies if c.dst == d and c.src == r) for r in (0, 1)}
        total = sum(sent.values())
        assert min(sent.values()) > 0.3 * total, f"load not spread over replicas: {sent}"
    # identical layouts on identical ranks: all local copies.
    p = plan_reallocation(cfg, _layout("t2p2d2", "head"), _layout("t2p2d2", "head"))
    assert {c.path for c in p.copies} == {LOCAL}
    # d2 on 8 ranks -> t1p1d1 on rank 7 (hostB): local from rank 7 itself, nothing else.
    p = plan_reallocation(cfg, _layout("t4p1d2", "head"), _layout("t1p1d1", "tail"), hosts=FAKE_HOSTS)
    assert {c.src for c in p.copies} <= {4, 5, 6, 7}, "same-host sources must be preferred"
    assert {c.path for c in p.copies} <= {LOCAL, SHM}
    p = plan_reallocation(cfg, _layout("t1p1d1", "head"), _layout("t1p1d1", "tail"), hosts=FAKE_HOSTS)
    assert {c.path for c in p.copies} == {P2P}
    t0 = time.perf_counter()
    a = plan_reallocation(cfg, _layout("t2p2d2", "head"), _layout("t1p4d2", "head"), hosts=FAKE_HOSTS)
    dt = time.perf_counter() - t0
    b = plan_reallocation(cfg, _layout("t2p2d2", "head"), _layout("t1p4d2", "head"), hosts=FAKE_HOSTS)
    assert a.fingerprint == b.fingerprint and a.copies == b.copies
    return {"plan_seconds": dt}


def case_all_pairs_two_hosts(ctx):
    totals = {"local_bytes": 0, "shm_read_bytes": 0, "p2p_recv_bytes": 0}
    for a in LAYOUTS:
        for b in LAYOUTS:
            st = _run_pair(ctx, a, "head", b, "tail", FAKE_HOSTS)
            for k in totals:
                totals[k] += st.get(k, 0)
    return totals


def case_same_host_and_back(ctx):
    from parallel.realloc import gather_hosts

    hosts = gather_hosts(timeout=30)
    assert len(set(hosts)) == 1
    pairs = [("t2p2d2", "t1p4d2"), ("t4p1d2", "t2p2d2"), ("t1p1d2", "t2p1d2"), ("t1p2d1", "t4p1d1"),
             ("t2p2d1", "t1p1d1"), ("t1p4d1", "t2p1d1"), ("t2p2d2", "t2p2d2")]
    n = 0
    for a, b in pairs:
        _run_pair(ctx, a, "head", b, "head", hosts, back=True)
        _run_pair(ctx, a, "head", b, "tail", hosts, back=True)
        n += 2
    return {"pairs": n}


def case_eta_blend(ctx):
    from parallel.realloc import plan_reallocation, prepare_reallocation, reallocate, reference_shard, shard_spec

    eta = 0.3
    cfg = _cfg()
    for a, b in [("t2p2d2", "t1p1d2"), ("t1p2d1", "t2p2d2"), ("t2p1d1", "t1p4d1")]:
        src_model, la = _model(ctx, a, "head", "a")
        dst_model, lb = _model(ctx, b, "tail", "b")
        if src_model is not None:
            _fill_reference(src_model, la, ctx=ctx)
        if dst_model is not None:
            _fill_reference(dst_model, lb, ctx=ctx, seed=1)
        plan = plan_reallocation(cfg, la, lb, hosts=FAKE_HOSTS)
        res = prepare_reallocation(plan, timeout=60)
        reallocate(plan, res, src_model, dst_model, eta=eta, timeout=60)
        res.close()
        if dst_model is not None:
            s_full, d_full = _full(ctx), _full(ctx, seed=1)
            params = _params(dst_model)
            for n, s in shard_spec(cfg, lb)[ctx.rank].items():
                want = eta * reference_shard(s, s_full[n]) + (1 - eta) * reference_shard(s, d_full[n])
                assert torch.equal(params[s.local_name], want), f"eta blend {la}->{lb}: {s.local_name}"
    return {}


def case_hf_checkpoint(ctx):
    from parallel.hf_io import load_hf_checkpoint, local_param_table, param_table, read_hf_tensors
    from parallel.hf_io import hf_to_mcore, tp_shard
    from parallel.model_config import hf_arch
    from parallel.realloc import plan_reallocation, prepare_reallocation, reallocate
    from parallel.realloc.sync import default_store, store_barrier
    from parallel.testing import make_tiny_hf

    path = os.path.join(ctx.tmpdir, "hf_realloc")
    if ctx.rank == 0:
        make_tiny_hf(path, family="qwen2", seed=3, **TINY, tie_word_embeddings=True)
    store_barrier(default_store(), "test/ckpt_written", range(WORLD), b"", 120, "checkpoint written")
    cfg = _cfg()
    whole, lw = _model(ctx, "t1p1d1", "head", "a")
    if whole is not None:
        load_hf_checkpoint(whole, path, cfg, hf_arch(cfg))
    ctx.cache.pop(f"filled:{lw}", None)  # the reference fill of this model is gone
    hf = read_hf_tensors(path)
    for b in LAYOUTS:
        dst_model, lb = _model(ctx, b, "tail", "b")
        if dst_model is not None:
            _scramble(dst_model)
        plan = plan_reallocation(cfg, lw, lb, hosts=FAKE_HOSTS)
        res = prepare_reallocation(plan, timeout=60)
        reallocate(plan, res, whole, dst_model, timeout=60)
        res.close()
        if dst_model is None:
            continue
        arch = hf_arch(cfg, tp_size=lb.strategy.tp)
        _, tp_rank, _ = lb.coords(ctx.rank)
        params = _params(dst_model)
        for e, n in local_param_table(dst_model, param_table(cfg, arch)):
            full = hf_to_mcore(e, [hf[h] for h in e.hf_names], arch.padded_vocab_size,
                               TINY["num_key_value_heads"])
            want = tp_shard(e, full, tp_rank, lb.strategy.tp)
            assert torch.equal(params[n], want), f"checkpoint -> {lb}: {n}"
    return {}


def case_errors(ctx):
    from parallel.realloc import ReallocError, offload, plan_reallocation, prepare_reallocation, reallocate, reload

    me = ctx.rank
    # 1. different model configs: the plan itself refuses (pure, every rank).
    other = _cfg()
    other.intermediate_size = 256
    try:
        plan_reallocation(_cfg(), _layout("t1p1d1", "head"), _layout("t1p1d1", "tail"), dst_hf_config=other)
        raise AssertionError("incompatible configs were accepted")
    except ReallocError as e:
        assert "incompatible" in str(e) and "linear_fc1" in str(e), str(e)
    la, lb = _layout("t1p1d2", "head"), _layout("t2p1d1", "tail")  # members 0, 1, 6, 7
    plan = plan_reallocation(_cfg(), la, lb, hosts=FAKE_HOSTS)
    res = prepare_reallocation(plan, timeout=60)
    from parallel.realloc import allocate_shards

    src = allocate_shards(plan.src_shards[me]) if me in la.workers else None
    if src is not None:
        for t in src.values():
            t.fill_(1.0)
    messages = {}

    def attempt(label, src_mod, dst_mod, expect):
        dst_before = {k: v.clone() for k, v in dst_mod.items()} if isinstance(dst_mod, dict) else None
        try:
            out = reallocate(plan, res, src_mod, dst_mod, timeout=30)
        except ReallocError as e:
            assert me in plan.members, "non-members must not raise"
            assert expect in str(e), f"{label}: {e}"
            messages[label] = str(e)
            if dst_before is not None:  # nothing moved
                assert all(torch.equal(dst_before[k], v) for k, v in dst_mod.items()), f"{label}: data moved"
            return
        assert me not in plan.members and out == {}, f"{label}: no error on rank {me}"

    # 2. wrong dtype on ONE rank (7): every member raises naming rank 7, nothing moved.
    dst = allocate_shards(plan.dst_shards[me], dtype=torch.bfloat16 if me == 7 else torch.float32) \
        if me in lb.workers else None
    attempt("dtype", src, dst, "rank 7: destination parameter")
    # 3. a destination member passes None.
    dst = allocate_shards(plan.dst_shards[me]) if me in lb.workers else None
    attempt("none", src, None if me == 6 else dst, "rank 6: this rank is a destination of the plan but passed no")
    # 4. an offloaded destination (real GPTModel stage): clear error, then reload and it works.
    dst_model, lm = _model(ctx, "t2p1d1", "tail", "b")
    plan2 = plan_reallocation(_cfg(), la, lm, hosts=FAKE_HOSTS)
    res2 = prepare_reallocation(plan2, timeout=60)
    src_model, _ = _model(ctx, "t1p1d2", "head", "a")
    if src_model is not None:
        _fill_reference(src_model, la, ctx=ctx)
    if dst_model is not None:
        offload(dst_model)
    try:
        reallocate(plan2, res2, src_model, dst_model, timeout=30)
        assert me not in plan2.members, "offloaded destination accepted"
    except ReallocError as e:
        assert "offloaded" in str(e) and "rank 6" in str(e) and "rank 7" in str(e), str(e)
    if dst_model is not None:
        reload(dst_model)
    reallocate(plan2, res2, src_model, dst_model, timeout=30)
    if dst_model is not None:
        _check_equal(dst_model, lm, _full(ctx), "after reload")
    # 5. the group still works after the errors: a normal reallocation succeeds.
    dst = allocate_shards(plan.dst_shards[me]) if me in lb.workers else None
    reallocate(plan, res, src, dst, timeout=30)
    if dst is not None:
        for n, s in plan.dst_shards[me].items():
            pad = sum(b - a for a, b in s.padding)
            assert int(dst[s.local_name].sum().item()) == dst[s.local_name].numel() - pad * (
                dst[s.local_name].numel() // s.local_shape[s.dim])
    res.close()
    res2.close()
    return {k: v[:200] for k, v in messages.items()}


def case_offload_gpt(ctx):
    from parallel.realloc import is_offloaded, offload, reload

    model, _ = _model(ctx, "t2p2d2", "head", "b")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = {n: id(p) for n, p in model.named_parameters()}
    total = sum(p.untyped_storage().nbytes() for p in model.parameters())
    state = offload(model)
    assert is_offloaded(model) and state.nbytes >= total
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters()), "storage not released"
    reload(model)
    assert not is_offloaded(model)
    for n, p in model.named_parameters():
        assert id(p) == ids[n] and torch.equal(p, before[n]), f"{n} not restored bitwise"
    return {"bytes": total}


# (last: its deliberate timeout leaves ranks 0-1 a few seconds behind the rest)
CASES = ["case_spec_matches_models", "case_plan_properties", "case_all_pairs_two_hosts",
         "case_same_host_and_back", "case_eta_blend", "case_hf_checkpoint", "case_errors",
         "case_offload_gpt", "case_missing_rank_times_out"]


def case_missing_rank_times_out(ctx):
    import time

    from parallel.realloc import (ReallocError, SyncTimeout, allocate_shards, plan_reallocation,
                                  prepare_reallocation, reallocate)

    la = Layout((0,), _strategy("t1p1d1"))
    lb = Layout((1, 2), _strategy("t1p1d2"))
    plan = plan_reallocation(_cfg(), la, lb)
    res = prepare_reallocation(plan, timeout=30)
    me = ctx.rank
    if me not in (0, 1):  # rank 2 is a member that never calls reallocate; ranks 3.. are not members
        return {}
    src = allocate_shards(plan.src_shards[0]) if me == 0 else None
    dst = allocate_shards(plan.dst_shards[1]) if me == 1 else None
    t0 = time.perf_counter()
    try:
        reallocate(plan, res, src, dst, timeout=3)
    except (SyncTimeout, ReallocError) as e:
        assert "[2]" in str(e), str(e)
        return {"seconds": time.perf_counter() - t0, "error": str(e)[:200]}
    raise AssertionError("no timeout although rank 2 never arrived")


# --------------------------------------------------------------------------- pytest


@pytest.fixture(scope="module")
def results():
    """Every case in the one 8-rank group (the missing-rank case included: a plan over ranks 0-2
    of the 8, so no second group has to start and import megatron)."""
    return run_cases([f"{MODULE}:{c}" for c in CASES], world_size=WORLD, timeout=420, pg_timeout=120,
                     pythonpath=[os.path.dirname(os.path.abspath(__file__))])


def test_realloc_cases(results):
    for c in CASES:
        if c != "case_missing_rank_times_out":
            assert results[c].ok, f"{c}: {results[c].error}"
    totals = results["case_all_pairs_two_hosts"].data
    assert sum(d["local_bytes"] for d in totals.values()) > 0
    assert sum(d["shm_read_bytes"] for d in totals.values()) > 0
    assert sum(d["p2p_recv_bytes"] for d in totals.values()) > 0


def test_missing_rank_is_named(results):
    r = results["case_missing_rank_times_out"]
    assert r.ok, r.error
    for rank in (0, 1):
        assert r.data[rank]["seconds"] < 15, r.data[rank]


def test_pure_spec_errors():
    from parallel.realloc import ShardSpecError, shard_spec
    from realflow.api.allocation import AllocationError

    cfg = _cfg()
    try:
        shard_spec(cfg, Layout((0, 1, 2), _strategy("t1p3")))
        raise AssertionError("4 layers on 3 stages accepted")
    except ShardSpecError as e:
        assert "pp=3" in str(e)
    try:
        Layout((0, 1), _strategy("t4"))
        raise AssertionError("wrong rank count accepted")
    except AllocationError as e:
        assert "needs 4 workers" in str(e)
