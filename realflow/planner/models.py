"""HF configs of common models by name, for planning without a checkpoint at hand.

Only architecture numbers (from the models' published config.json files); ``model=`` also
takes a checkpoint directory or a config.json path.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "rms_norm_eps": 1e-6,
          "rope_theta": 1000000.0, "max_position_embeddings": 32768}
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-1.5b": {**_QWEN2, "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
                     "num_key_value_heads": 2, "intermediate_size": 8960, "vocab_size": 151936,
                     "tie_word_embeddings": True},
    "qwen2.5-7b": {**_QWEN2, "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
                   "tie_word_embeddings": False},
    "qwen2.5-32b": {**_QWEN2, "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 40,
                    "num_key_value_heads": 8, "intermediate_size": 27648, "vocab_size": 152064,
                    "tie_word_embeddings": False},
    "llama3-70b": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
                   "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
                   "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                   "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
                   "tie_word_embeddings": False},
}


def load_model_config(name_or_path: str) -> dict[str, Any]:
    """A preset's HF config, or the config.json of a checkpoint directory / file."""
    if name_or_path in MODEL_PRESETS:
        return dict(MODEL_PRESETS[name_or_path])
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"model={name_or_path!r}: not a preset ({', '.join(sorted(MODEL_PRESETS))}), "
                         f"a checkpoint directory or a config.json")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"model={name_or_path!r}: {path} is not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"model={name_or_path!r}: {path} does not hold a JSON object")
    return cfg
