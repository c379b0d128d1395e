"""Run test cases on a real multi-process group (gloo on CPU, 127.0.0.1; NCCL beside it on GPUs).

Starting processes and importing megatron costs seconds, so a test module
starts ONE group and runs all its cases in it::

    results = run_cases(["test_parallel_x:case_a", "test_parallel_x:case_b"], world_size=2)
    assert results["case_a"].ok, results["case_a"].error

Each case is a top-level function ``case(ctx: CaseContext) -> dict | None``
run on every rank, in order.  Ranks are plain subprocesses (``python -m
parallel.testing``) rendezvousing through a FileStore; results come back as
JSON files.  After a case fails on any rank, later cases are skipped (the
group's collectives may be out of step).  Every wait has a timeout; a timeout
names the ranks that did not finish and the case each was running.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

__all__ = ["CaseContext", "CaseResult", "run_cases", "make_tiny_hf", "paged_attention_reference"]


@dataclass
class CaseContext:
    rank: int
    world_size: int
    tmpdir: str  # shared by all ranks of the run
    cache: dict[str, Any] = field(default_factory=dict)  # per process, across cases


@dataclass
class CaseResult:
    ok: bool
    error: str = ""
    seconds: float = 0.0
    data: dict[int, Any] = field(default_factory=dict)  # rank -> what the case returned


def _worker(rank: int, world: int, store: str, cases: list[str], out_dir: str,
            pg_timeout: float) -> None:
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from realflow.base.devices import distributed_backend, select_device

    select_device(rank)
    dist.init_process_group(distributed_backend(), init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=pg_timeout))
    ctx = CaseContext(rank, world, os.path.dirname(store))
    results: dict[str, Any] = {}
    progress = os.path.join(out_dir, f"progress.{rank}")
    failed = False
    for spec in cases:
        name = spec.rsplit(":", 1)[1]
        if failed:
            results[name] = {"ok": False, "error": "skipped: an earlier case failed"}
            continue
        with open(progress, "w") as f:
            f.write(name)
        t0 = time.perf_counter()
        try:
            mod, fn = spec.rsplit(":", 1)
            data = getattr(importlib.import_module(mod), fn)(ctx)
            results[name] = {"ok": True, "data": data}
        except Exception as e:  # noqa: BLE001 - reported to the parent test
            tb = traceback.format_exc(limit=-6)
            results[name] = {"ok": False, "error": f"rank {rank}: {type(e).__name__}: {e}\n{tb}"}
        results[name]["seconds"] = time.perf_counter() - t0
        flag = torch.tensor([0 if results[name]["ok"] else 1])
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            failed = bool(flag.item())
        except Exception:  # noqa: BLE001 - a peer is gone or stuck
            failed = True
        with open(os.path.join(out_dir, f"result.{rank}.json"), "w") as f:
            json.dump(results, f, default=str)
    with open(progress, "w") as f:
        f.write("<done>")
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def run_cases(cases: list[str], world_size: int, timeout: float = 240.0,
              pg_timeout: float = 60.0, pythonpath: Optional[list[str]] = None,
              env: Optional[dict[str, str]] = None) -> dict[str, CaseResult]:
    """Run ``module:function`` cases on ``world_size`` ranks (gloo; with NCCL beside it on
    GPUs, rank r on GPU r); results by case name.  ``env`` is added to the ranks'
    environment (``CUDA_VISIBLE_DEVICES=""`` runs a CPU reference on a GPU host)."""
    tmp = tempfile.mkdtemp(prefix="rf_gloo_")
    store = os.path.join(tmp, "store")
    extra_env = dict(env or {})
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < world_size:
        # NCCL refuses two ranks on one GPU: a group larger than the host's GPUs runs on CPU
        extra_env.setdefault("CUDA_VISIBLE_DEVICES", "")
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               MASTER_ADDR="127.0.0.1", PYTHONWARNINGS="ignore", **extra_env)
    extra = list(pythonpath or []) + [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    env["PYTHONPATH"] = os.pathsep.join(extra + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    procs = []
    for r in range(world_size):
        cmd = [sys.executable, "-m", "parallel.testing", "--rank", str(r), "--world",
               str(world_size), "--store", store, "--out", tmp, "--pg-timeout", str(pg_timeout),
               *cases]
        log = open(os.path.join(tmp, f"log.{r}"), "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    for p, log in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
    hung = []
    for r, (p, log) in enumerate(procs):
        if p.poll() is None:
            p.kill()
            p.wait()
            try:
                with open(os.path.join(tmp, f"progress.{r}")) as f:
                    where = f.read()
            except OSError:
                where = "<startup>"
            hung.append(f"rank {r} (in {where})")
        log.close()

    per_rank: list[dict[str, Any]] = []
    for r in range(world_size):
        try:
            with open(os.path.join(tmp, f"result.{r}.json")) as f:
                per_rank.append(json.load(f))
        except OSError:
            per_rank.append({})
    out: dict[str, CaseResult] = {}
    for spec in cases:
        name = spec.rsplit(":", 1)[1]
        res = CaseResult(ok=True)
        for r, rr in enumerate(per_rank):
            item = rr.get(name)
            if item is None:
                res.ok = False
                tail = _tail(os.path.join(tmp, f"log.{r}"))
                why = f"timed out after {timeout:.0f}s: {', '.join(hung)}" if hung else "no result"
                res.error += f"rank {r}: {why}\n{tail}\n"
                continue
            res.seconds = max(res.seconds, float(item.get("seconds", 0.0)))
            res.data[r] = item.get("data")
            if not item["ok"]:
                res.ok = False
                res.error += item["error"] + "\n"
        out[name] = res
    shutil.rmtree(tmp, ignore_errors=True)
    return out


_TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


# a tiny Qwen3-MoE: 8 experts, 2 per token (every layer sparse, as Qwen3-30B-A3B)
_TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                 router_aux_loss_coef=0.01)


# a tiny Qwen2.5-VL: the language model as _TINY (head_dim 16: mrope_section 2+3+3 = 8 pairs), a
# 2-block vision tower (one windowed block, one full-attention block) with 56-pixel windows
_TINY_VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, fullatt_block_indexes=[1],
                    window_size=56, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
TINY_VL_TOKENS = dict(image_token_id=150, vision_start_token_id=151, vision_end_token_id=152)


_TINY_VISION_QWEN2 = dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
                         temporal_patch_size=2)


def _tiny_vl_config(kw: dict, family: str = "qwen2_5_vl") -> Any:
    import transformers as tf

    text = {k: v for k, v in kw.items() if k not in ("vision_config",) and k not in TINY_VL_TOKENS}
    text.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    text.setdefault("bos_token_id", 1)
    text.setdefault("eos_token_id", 2)
    tokens = {k: kw.get(k, v) for k, v in TINY_VL_TOKENS.items()}
    if family == "qwen2_vl":  # Qwen2-VL's tower: no windows, its hidden_size is the merger's output
        vision = dict(_TINY_VISION_QWEN2, hidden_size=text["hidden_size"], **kw.get("vision_config", {}))
        return tf.Qwen2VLConfig(text_config=text, vision_config=vision, bos_token_id=text["bos_token_id"],
                                eos_token_id=text["eos_token_id"],
                                tie_word_embeddings=bool(kw.get("tie_word_embeddings", False)), **tokens)
    vision = dict(_TINY_VISION, out_hidden_size=text["hidden_size"], **kw.get("vision_config", {}))
    return tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, bos_token_id=text["bos_token_id"],
                               eos_token_id=text["eos_token_id"],
                               tie_word_embeddings=bool(kw.get("tie_word_embeddings", False)), **tokens)


def make_tiny_hf(path: str, family: str = "qwen2", seed: int = 0,
                 max_shard_size: Optional[str] = None, critic: bool = False, **overrides: Any):
    """Save a random tiny HF model (safetensors) to ``path``; return (config, model).

    Norm weights and biases are perturbed away from their constant init so that a
    mapping mistake (e.g. swapped norms) cannot hide behind identical values.
    ``critic=True`` saves a ``*ForTokenClassification`` with ``num_labels=1``
    (realflow's critic format).
    """
    import torch
    import transformers as tf

    classes = {"qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
               "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
               "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
               "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
               "qwen2_5_vl": (_tiny_vl_config, tf.Qwen2_5_VLForConditionalGeneration),
               "qwen2_vl": (lambda kw: _tiny_vl_config(kw, "qwen2_vl"), tf.Qwen2VLForConditionalGeneration)}
    cfg_cls, model_cls = classes[family]
    if critic:
        model_cls = getattr(tf, model_cls.__name__.replace("ForCausalLM", "ForTokenClassification"))
        overrides.setdefault("num_labels", 1)
    kw = dict(_TINY) if family != "qwen2_5_vl" else {}  # (the VL config starts from _TINY itself)
    if family == "qwen3_moe":
        kw.update(_TINY_MOE)
    kw.update(overrides)
    config = cfg_cls(kw) if family in ("qwen2_5_vl", "qwen2_vl") else cfg_cls(**kw)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # MoE router: decisive top-k, not near-ties
                p.normal_(0.0, 0.5)
    if max_shard_size:
        model.save_pretrained(path, max_shard_size=max_shard_size)
    else:
        model.save_pretrained(path)
    return config, model


def paged_attention_reference(q: Any, k_pool: Any, v_pool: Any, tables: Any, lens: Any, scale: float,
                              block_size: int) -> Any:
    """Decode attention over each row's context gathered through its block table, one row and
    kv group at a time (what :mod:`parallel.generation.paged_attention`'s kernel must equal):
    ``q [B, groups, rep, hd]``, pools ``[rows, groups, hd]``, ``tables [B, W]``, ``lens [B]``."""
    import torch

    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(lens[b])
        t = torch.arange(n)
        rows = tables[b].cpu()[t // block_size] * block_size + t % block_size
        k, v = k_pool[rows], v_pool[rows]  # [n, groups, hd]
        for g in range(q.shape[1]):
            out[b, g] = torch.softmax(q[b, g] @ k[:, g].T * scale, -1) @ v[:, g]
    return out


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path) as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _main() -> None:
    ap = argparse.ArgumentParser(description="one rank of parallel.testing.run_cases")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pg-timeout", type=float, default=60.0)
    ap.add_argument("cases", nargs="+")
    a = ap.parse_args()
    _worker(a.rank, a.world, a.store, a.cases, a.out, a.pg_timeout)


if __name__ == "__main__":
    _main()
