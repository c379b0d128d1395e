"""How LoRA policies are served: the SGLang command line and the rollout checks (SGLang itself
cannot run here: no GPU; its adapter rounds are real code in realflow/weights/rounds.py)."""
from __future__ import annotations

import pytest

from parallel.generation.sglang_backend import sglang_command
from realflow.api.generation import BackendConfig
from realflow.api.rollout import RolloutError, RolloutSpec


def test_sglang_is_started_for_lora_serving():
    cfg = BackendConfig(model_path="/m", lora={"r": 16, "alpha": 32.0, "target_modules": ["q_proj", "v_proj"]})
    cmd = sglang_command(cfg, "127.0.0.1", 30000)
    assert "--enable-lora" in cmd
    assert cmd[cmd.index("--max-lora-rank") + 1] == "16"
    i = cmd.index("--lora-target-modules")
    assert cmd[i + 1:i + 3] == ["q_proj", "v_proj"]
    assert "--enable-lora" not in sglang_command(BackendConfig(model_path="/m"), "127.0.0.1", 30000)


def test_lora_on_sglang_needs_disk_sync_and_turns_delta_sync_off():
    base = dict(model_path="/m", tokenizer_path="/m", dataset_path="/d", lora={"r": 8, "alpha": 16.0,
                                                                               "target_modules": ["q_proj"]})
    with pytest.raises(RolloutError, match="weight_sync=disk"):
        RolloutSpec(**base, backend="sglang", weight_sync="memory")
    RolloutSpec(**base, backend="sglang", weight_sync="disk")
    assert not RolloutSpec(**base, weight_sync="memory").delta_sync_on()  # the adapters are the delta
