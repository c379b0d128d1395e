"""Dumps with an injected fault, for the mismatch doctor's tests (and its docs' measured reports).

Each writer generates real samples with the built-in generation engine from the weights the
fault says the generator had, and writes them with :func:`realflow.system.mismatch_dump.write_dump`
beside the weights the trainer had (an HF checkpoint: ``weights/``, and ``gen_weights/`` for a
generator with its own copy).
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Optional

import torch

from parallel.generation import EngineConfig, GenerationEngine
from realflow.api.generation import SamplingParams
from realflow.system.mismatch_dump import WEIGHTS_DIR, DumpSample, MismatchDump, dump_dir, write_dump

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [20, 21, 22], [30, 31, 32, 33, 34], [40, 41], [50, 51, 52, 53]]
NEW_TOKENS = 10
TEMPERATURE = 1.0


def perturbed(src: str, dst: str, layer: Optional[int] = None, op: str = "mlp", scale: float = 0.05,
              seed: int = 1) -> str:
    """A copy of HF checkpoint ``src`` at ``dst`` with noise added: to one layer's MLP down projection
    (or attention output projection, ``op="attention"``) when ``layer`` is given, else to every tensor
    (a training step's worth of change)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    part = "mlp.down_proj.weight" if op == "mlp" else "self_attn.o_proj.weight"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if layer is None or name == f"model.layers.{layer}.{part}":
                p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=g))
    model.save_pretrained(dst)
    return dst


def generate(path: str, precision: str = "fp32", seed: int = 0) -> list[Any]:
    """The generation engine's samples of :data:`PROMPTS` from checkpoint ``path``."""
    eng = GenerationEngine.from_hf(path, EngineConfig(max_running_requests=len(PROMPTS)), tokenizer=None,
                                   dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    return eng.generate(PROMPTS, [SamplingParams(max_new_tokens=NEW_TOKENS - i, temperature=TEMPERATURE, seed=seed + i,
                                                 ignore_eos=True) for i in range(len(PROMPTS))])


def write(run_dir: str, step: int, weights: str, results: list[Any], version: int, *,
          gen_weights: Optional[str] = None, settings: Optional[dict[str, Any]] = None,
          weights_version: Optional[int] = None) -> str:
    """A dump of ``results`` (labelled weight ``version``) with ``weights`` as the trainer's copy (of
    ``weights_version``, default ``version``)."""
    samples = [DumpSample(id=f"s{i}", input_ids=list(r.prompt_ids) + list(r.output_ids), prompt_len=len(r.prompt_ids),
                          behaviour_logprobs=[float(x) for x in r.output_logprobs],
                          versions=[version] * len(r.output_ids)) for i, r in enumerate(results)]
    d = dump_dir(run_dir, step)
    shutil.copytree(weights, os.path.join(d, WEIGHTS_DIR))
    if gen_weights:
        shutil.copytree(gen_weights, os.path.join(d, "gen_weights"))
    s = {"trainer_precision": "fp32", "gen_precision": "fp32", "temperature": TEMPERATURE,
         "max_tokens_per_mb": 8192, "engine": "builtin", **(settings or {})}
    return write_dump(run_dir, MismatchDump(step=step, model="actor", settings=s,
                                            weights_version=version if weights_version is None else weights_version,
                                            samples=samples))
