"""The ``sglang`` generation backend: SGLang's own server, driven by the same client.

On GPU, SGLang already speaks the HTTP API realflow's gen server copies
(``/generate``, ``/update_weights_from_disk``, ``/pause_generation``, ...), so
this backend does not wrap an engine: ``gen_server --backend sglang`` replaces
itself with ``python -m sglang.launch_server`` and
:class:`realflow.rollout.gen_client.GenerationClient` talks to it unchanged.
Imports are lazy: nothing here needs CUDA or sglang until it is used.  Not
tested in CI (no GPU, no sglang on CPU machines).

Vision-language models: ``/generate``'s ``image_data`` is SGLang's own field, so the client and
the rollout controller send it unchanged (base64 / data URLs, one list per prompt). UNTESTED
here: SGLang processes images with the model's ``preprocessor_config.json`` (it has no
min/max-pixels flags), so that file's budget must equal ``rollout.server_limits.min_pixels`` /
``max_pixels`` for the trainer to see the pixels SGLang saw, and whether SGLang takes prompts
whose placeholders are already expanded (what realflow's rollout side sends) is to be checked
on a GPU host.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass

from realflow.api.generation import BackendConfig, generation_backends
from realflow.api.routing import moe_routing_of

__all__ = ["SGLangServerBackend", "sglang_available", "sglang_command"]


def sglang_available() -> bool:
    """True when sglang is importable and CUDA is usable."""
    if importlib.util.find_spec("sglang") is None:
        return False
    import torch

    return torch.cuda.is_available()


def sglang_command(cfg: BackendConfig, host: str, port: int) -> list[str]:
    """The ``sglang.launch_server`` command line for ``cfg`` (extra options become flags)."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", cfg.model_path,
           "--host", host, "--port", str(port), "--dtype", cfg.dtype,
           "--max-running-requests", str(cfg.max_running_requests),
           "--random-seed", str(cfg.seed)]
    if cfg.tokenizer_path:
        cmd += ["--tokenizer-path", cfg.tokenizer_path]
    # SGLang's names for the two keys (its fraction counts the GPU's memory for weights + KV cache,
    # the built-in engine's the free memory for its KV cache: the same knob, one name for users)
    cmd += ["--mem-fraction-static", str(cfg.gpu_memory_utilization)]
    if cfg.max_model_len:
        cmd += ["--context-length", str(cfg.max_model_len)]
    if cfg.enforce_eager:
        cmd.append("--disable-cuda-graph")
    if not cfg.prefix_sharing:
        cmd.append("--disable-radix-cache")
    if cfg.lora:  # LoRA serving: adapters load through /load_lora_adapter (realflow.weights.rounds)
        cmd += ["--enable-lora", "--max-lora-rank", str(cfg.lora["r"]), "--max-loras-per-batch", "1"]
        if cfg.lora.get("target_modules"):
            cmd += ["--lora-target-modules", *cfg.lora["target_modules"]]
    if moe_routing_of(cfg.model_path) is not None and "enable_return_routed_experts" not in cfg.extra:
        # MoE: routing replay needs the experts each token went to; SGLang records them only with
        # this flag, and returns them for requests with return_routed_experts=true (the rollout
        # controller's ServerPool sends it; realflow.api.routing decodes SGLang's base64 int32).
        # UNTESTED here (no GPU, no sglang): the flag and format are from SGLang's PR 12162.
        cmd.append("--enable-return-routed-experts")
    for k, v in sorted(cfg.extra.items()):
        flag = "--" + k.replace("_", "-")
        if v is True:
            cmd.append(flag)
        elif v not in (False, None):
            cmd += [flag, str(v)]
    return cmd


@dataclass
class SGLangServerBackend:
    """:class:`realflow.api.generation.ExternalServerBackend` running SGLang."""

    cfg: BackendConfig

    def serve(self, host: str, port: int) -> int:
        if not sglang_available():
            raise RuntimeError("the sglang backend needs CUDA and the sglang package "
                               "(pip install 'realflow[sglang]'); use --backend builtin on CPU")
        if port == 0:
            raise ValueError("the sglang backend needs an explicit --port (SGLang cannot bind port 0)")
        cmd = sglang_command(self.cfg, host, port)
        proc = subprocess.Popen(cmd, env=dict(os.environ))
        try:
            return proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            return proc.wait(timeout=30)


generation_backends.register("sglang", SGLangServerBackend)
