"""The GPU paths: the same engine, generation engine and runtime on CUDA give the CPU's numbers.

Skipped without CUDA (CI has no GPU); run on a GPU host with ``python -m pytest
tests/test_parallel_cuda.py``.  ``REALFLOW_DEVICE_TESTS_ON_CPU=1`` runs the same
assertions on CPU (to check the test itself on a machine without a GPU).

* MegatronEngine on the GPU (fp32, TF32 off): packed logits equal transformers on the
  CPU (LOGIT_ATOL); 3 AdamW steps with clipping and a cosine schedule equal plain
  PyTorch on the CPU (PARAM_ATOL); results come back as host tensors.
* bf16 parameters on the GPU (megatron's mixed-precision optimizer): the loss follows
  the fp32 run within BF16_LOSS_RTOL.
* The generation engine on the GPU, from an HF checkpoint and sharing a megatron
  engine's parameters: greedy tokens equal transformers' greedy decoding on the CPU, with the
  paged decode replayed from CUDA graphs and with ``enforce_eager``; a sampled group gives the
  same tokens both ways.
* The runtime on one GPU worker (NCCL beside gloo): SFT's per-step losses at
  ``precision=fp32`` equal the same run on the CPU (RUN_LOSS_RTOL), and the GPU default
  (bf16 parameters) follows them within BF16_RUN_RTOL; sync GRPO and async PPO (gen
  server on the GPU too) finish with finite rewards and losses in the default bf16.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from parallel.testing import make_tiny_hf, run_cases

ON_GPU = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not ON_GPU and os.environ.get("REALFLOW_DEVICE_TESTS_ON_CPU") != "1",
                                reason="needs a CUDA device")
MODULE = __name__.rsplit(".", 1)[-1]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE = "cuda" if ON_GPU else "cpu"
LOGIT_ATOL = 1e-4  # fp32 on the GPU (TF32 off) vs transformers fp32 on the CPU
PARAM_ATOL = 1e-4  # after 3 AdamW steps (the CPU engine test holds 1e-5; GPU kernels sum in other orders)
BF16_LOSS_RTOL = 0.03
RUN_LOSS_RTOL = 1e-3  # per-step SFT loss, GPU run vs CPU run, 12 steps, fp32
BF16_RUN_RTOL = 0.05  # per-step SFT loss, bf16 parameters vs fp32 (12 steps from the same init)
CASES = ["case_engine_fp32", "case_generation", "case_engine_bf16"]


def _out_dir() -> str:
    return os.environ["RF_CASE_OUT"]


def _setup(ctx):
    """(path, hf_config, groups): the tiny checkpoint and a 1-rank layout, once per process."""
    from parallel.groups import ParallelStrategy, build_model_groups
    from transformers import AutoConfig

    if "setup" not in ctx.cache:
        path = os.path.join(ctx.tmpdir, "qwen2")
        make_tiny_hf(path, "qwen2", seed=7, tie_word_embeddings=False)
        groups = build_model_groups([0], ParallelStrategy(1, 1, 1))
        ctx.cache["setup"] = (path, AutoConfig.from_pretrained(path), groups)
    return ctx.cache["setup"]


def _batches(vocab: int):
    from test_parallel_engine_dp import STEPS, _global_batch

    return [_global_batch(k, vocab) for k in range(STEPS)]


def case_engine_fp32(ctx):
    from parallel.engine import MegatronEngine
    from test_parallel_engine_dp import _micro_batch, _opt_cfg, loss_fn, loss_weight_fn

    torch.backends.cuda.matmul.allow_tf32 = False
    path, cfg, groups = _setup(ctx)
    eng = MegatronEngine(cfg, groups, path, optimizer_config=_opt_cfg(), seed=1)
    seen = {"param_device": str(eng.device)}
    seqlens = [5, 17, 1, 9, 30]
    ids = torch.randint(0, cfg.vocab_size, (sum(seqlens),), generator=torch.Generator().manual_seed(0))
    logits = eng.forward(ids, seqlens, max_tokens_per_mb=20)
    lp = eng.logprobs(ids, seqlens)
    seen["result_devices"] = sorted({str(logits.device), str(lp.device)})
    stats = [eng.train_batch([_micro_batch(s[:2]), _micro_batch(s[2:])], loss_fn, loss_weight_fn)
             for s in _batches(cfg.vocab_size)]
    torch.save({"ids": ids, "seqlens": seqlens, "logits": logits, "logprobs": lp, "stats": stats,
                "params": eng.full_hf_state()}, os.path.join(_out_dir(), "fp32.pt"))
    return seen


def case_generation(ctx):
    from parallel.engine import MegatronEngine
    from parallel.generation import EngineConfig, GenerationEngine
    from realflow.api.generation import SamplingParams

    path, cfg, groups = _setup(ctx)
    prompts = [[5], [7, 8, 9], list(range(10, 27)), [100, 101]]
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    out = {}
    from_hf = GenerationEngine.from_hf(path, EngineConfig(max_running_requests=4), tokenizer=None)
    eager = GenerationEngine.from_hf(path, EngineConfig(max_running_requests=4, enforce_eager=True), tokenizer=None)
    gather = GenerationEngine.from_hf(path, EngineConfig(max_running_requests=4, decode_attention="gather"),
                                      tokenizer=None)
    meg = MegatronEngine(cfg, groups, path, optimizer_config=None, seed=1)
    shared = GenerationEngine.from_megatron(meg, EngineConfig(max_running_requests=4))
    for name, eng in (("from_hf", from_hf), ("from_hf_eager", eager), ("from_hf_gather", gather),
                      ("from_megatron", shared)):
        res = eng.generate(prompts, greedy)
        out[name] = {"device": str(eng.weights.device), "tokens": [r.output_ids for r in res],
                     "logprobs": [list(map(float, r.output_logprobs)) for r in res],
                     "graphs": eng.stats()["cuda_graphs"], "kernel": eng.stats()["paged_attention_kernel"]}
    # a sampled group (shared prompt, copy-on-write) replayed from CUDA graphs equals the eager step
    group = SamplingParams(max_new_tokens=12, n=4, seed=5, ignore_eos=True)
    out["group"] = {name: [r.output_ids for r in eng.generate([prompts[2]], group)]
                    for name, eng in (("graphs", from_hf), ("eager", eager))}
    out["prompts"] = prompts
    return out


def case_engine_bf16(ctx):
    from parallel.engine import MegatronEngine
    from test_parallel_engine_dp import _micro_batch, _opt_cfg, loss_fn, loss_weight_fn

    path, cfg, groups = _setup(ctx)
    eng = MegatronEngine(cfg, groups, path, optimizer_config=_opt_cfg(), seed=1,
                         config_overrides={"bf16": True, "params_dtype": torch.bfloat16})
    stats = [eng.train_batch([_micro_batch(s)], loss_fn, loss_weight_fn) for s in _batches(cfg.vocab_size)]
    return {"dtype": str(next(eng.module.parameters()).dtype), "losses": [s["loss"] for s in stats]}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("cuda_cases")
    res = run_cases([f"{MODULE}:{c}" for c in CASES], world_size=1, timeout=300,
                    pythonpath=[os.path.dirname(os.path.abspath(__file__))], env={"RF_CASE_OUT": str(out)})
    return res, out


def _ok(res, name):
    assert res[name].ok, res[name].error
    return res[name].data[0]


def test_engine_on_device_equals_cpu_references(cases):
    from test_parallel_engine_dp import _opt_cfg, _torch_reference
    from transformers import AutoConfig, Qwen2ForCausalLM

    res, out = cases
    seen = _ok(res, "case_engine_fp32")
    assert seen["param_device"].startswith(DEVICE), seen
    assert seen["result_devices"] == ["cpu"], seen  # host tensors for the data layer
    got = torch.load(out / "fp32.pt")
    # the case wrote the checkpoint in its own tmpdir (gone): rebuild the same one here
    path = str(out / "qwen2")
    make_tiny_hf(path, "qwen2", seed=7, tie_word_embeddings=False)
    hf = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids, seqlens = got["ids"], got["seqlens"]
    ref, o = [], 0
    with torch.no_grad():
        for n in seqlens:
            ref.append(hf(ids[o:o + n][None]).logits[0])
            o += n
    ref = torch.cat(ref)
    assert (got["logits"] - ref).abs().max() < LOGIT_ATOL
    ref_lp = torch.log_softmax(ref, -1)
    o = 0
    for n in seqlens:
        for t in range(n - 1):
            assert abs(float(got["logprobs"][o + t]) - float(ref_lp[o + t, ids[o + t + 1]])) < LOGIT_ATOL
        o += n
    cfg = AutoConfig.from_pretrained(path)
    params, losses, norms = _torch_reference(path, _opt_cfg(), _batches(cfg.vocab_size))
    for k, s in enumerate(got["stats"]):
        assert s["loss"] == pytest.approx(losses[k], rel=1e-5), (k, s["loss"], losses[k])
        assert s["grad_norm"] == pytest.approx(norms[k], rel=1e-4), (k, s["grad_norm"], norms[k])
    assert set(got["params"]) == set(params)
    worst = max(float((got["params"][n] - params[n]).abs().max()) for n in params)
    assert worst < PARAM_ATOL, worst


def test_generation_on_device_equals_transformers_greedy(cases):
    from transformers import Qwen2ForCausalLM

    res, out = cases
    data = _ok(res, "case_generation")
    path = str(out / "qwen2_gen")
    make_tiny_hf(path, "qwen2", seed=7, tie_word_embeddings=False)
    hf = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if ON_GPU:  # the paged decode runs from CUDA graphs unless enforce_eager, through the Triton kernel
        assert data["from_hf"]["graphs"] > 0 and data["from_hf_eager"]["graphs"] == 0
        assert data["from_hf"]["kernel"] == 1.0 and data["from_hf_gather"]["kernel"] == 0.0
    assert data["group"]["graphs"] == data["group"]["eager"]
    for name in ("from_hf", "from_hf_eager", "from_hf_gather", "from_megatron"):
        assert data[name]["device"].startswith(DEVICE), data[name]
        for p, toks, lps in zip(data["prompts"], data[name]["tokens"], data[name]["logprobs"]):
            seq = list(p)
            with torch.no_grad():
                for tok, lp in zip(toks, lps):
                    logits = hf(torch.tensor([seq])).logits[0, -1]
                    assert tok == int(logits.argmax()), (name, p, toks)
                    assert abs(lp - float(torch.log_softmax(logits, -1)[tok])) < LOGIT_ATOL
                    seq.append(tok)


@pytest.mark.skipif(not ON_GPU, reason="the compiled Triton kernel needs a GPU (CPU: test_paged_attention_kernel)")
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_paged_attention_kernel_compiled(dtype, atol):
    """The compiled kernel against attention over the gathered context (in fp32), GQA 16 q / 8 kv heads."""
    from parallel.generation.paged_attention import paged_decode_attention
    from parallel.testing import paged_attention_reference as reference

    g = torch.Generator().manual_seed(3)
    B, ng, rep, hd, bs, blocks, width = 6, 8, 2, 128, 16, 300, 40
    k = torch.randn(blocks * bs + 1, ng, hd, generator=g)
    v = torch.randn(blocks * bs + 1, ng, hd, generator=g)
    q = torch.randn(B, ng, rep, hd, generator=g)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in range(B)])
    lens = torch.tensor([1, 16, 17, 100, 511, 640])
    got = paged_decode_attention(q.to("cuda", dtype), k.to("cuda", dtype), v.to("cuda", dtype), tables.cuda(),
                                 lens.cuda(), hd ** -0.5, bs)
    want = reference(q.to(dtype).float(), k.to(dtype).float(), v.to(dtype).float(), tables, lens, hd ** -0.5, bs)
    assert (got.float().cpu() - want).abs().max().item() <= atol


def test_bf16_training_follows_fp32(cases):
    res, out = cases
    data = _ok(res, "case_engine_bf16")
    assert data["dtype"] == "torch.bfloat16"
    fp32 = [s["loss"] for s in torch.load(out / "fp32.pt")["stats"]]
    assert data["losses"] == pytest.approx(fp32, rel=BF16_LOSS_RTOL)


# ------------------------------------------------------------------ the runtime on one GPU worker

SMALL_SFT = ["dataset.n_train=1000", "dataset.n_test=32", "model.arch.hidden_size=64",
             "model.arch.num_hidden_layers=2", "model.arch.intermediate_size=128", "batch_size=32",
             "optimizer.lr=3e-3", "n_workers=1", "trace=false"]


def _launch(module, fileroot, *overrides, env=None, timeout=400):
    cmd = [sys.executable, "-m", module, f"fileroot={fileroot}", *overrides]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                         env=dict(os.environ, **(env or {})))
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-4000:])
    return res


def _stats(run_dir):
    with open(os.path.join(run_dir, "stats.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def sft_roots(tmp_path_factory):
    """The same 12-step SFT run on the device and on the CPU (CUDA hidden) in fp32, and on the
    device in its default precision (bf16 on a GPU)."""
    roots = {}
    for where, env, precision in (("device", {}, "fp32"), ("cpu", {"CUDA_VISIBLE_DEVICES": ""}, "fp32"),
                                  ("device_default", {}, "auto")):
        roots[where] = tmp_path_factory.mktemp(f"sft_{where}")
        _launch("realflow.apps.main_sft", roots[where], *SMALL_SFT, "max_train_steps=12", f"precision={precision}",
                env=env)
    return roots


@pytest.mark.timeout(900)
def test_sft_run_on_device_equals_cpu_run(sft_roots):
    losses = {}
    for where, root in sft_roots.items():
        steps = [r for r in _stats(root / "sft" / "trial0") if "sft_train/loss" in r]
        losses[where] = [r["sft_train/loss"] for r in steps]
    assert len(losses["device"]) == 12
    assert losses["device"] == pytest.approx(losses["cpu"], rel=RUN_LOSS_RTOL)
    assert losses["device_default"] == pytest.approx(losses["cpu"], rel=BF16_RUN_RTOL)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("module", ["realflow.apps.main_sync_ppo", "realflow.apps.main_async_ppo"])
def test_rl_runs_on_one_device_worker(sft_roots, module, tmp_path):
    import math
    import shutil

    for sub in ("sft", "data"):
        shutil.copytree(sft_roots["device_default"] / sub, tmp_path / sub)
    # the async default's task (worked_arithmetic) would train its own SFT start first: minutes
    fast = ["dataset.task=arithmetic", "ppo.max_new_tokens=16", "dataset.n_test=32", "eval_n_samples=2",
            "dataset.n_train=1000"] if module.endswith("async_ppo") else []
    _launch(module, tmp_path, *fast, "max_train_steps=3", "n_workers=1", "trace=false")
    run_dirs = [os.path.dirname(p) for p in map(str, tmp_path.rglob("stats.jsonl")) if "/sft/" not in p]
    assert len(run_dirs) == 1, run_dirs
    rows = _stats(run_dirs[0])
    rewards = [v for r in rows for k, v in r.items() if k.endswith("reward") or k.endswith("/reward_mean")]
    losses = [v for r in rows for k, v in r.items() if k.endswith("/loss")]
    assert rewards and losses, sorted({k for r in rows for k in r})
    assert all(math.isfinite(v) for v in rewards + losses)
