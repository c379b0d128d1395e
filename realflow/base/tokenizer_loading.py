"""Load a tokenizer directory as the class it was saved as.

transformers 5's ``AutoTokenizer`` picks the tokenizer class from ``config.json``'s
``model_type`` when a model sits in the same directory: a checkpoint of our task models
(``model_type: qwen2``) then loads its plain ``PreTrainedTokenizerFast`` as a
``Qwen2Tokenizer``, whose pre-tokenizer splits text differently. The tokens a rollout
worker, a proxy or a generation server build would no longer be the tokens the model was
trained on. The class named in ``tokenizer_config.json`` is what the writer meant, so it wins.
"""
from __future__ import annotations

import json
import os
from typing import Any

# Classes loaded as themselves rather than through AutoTokenizer's model-type lookup
# (transformers 5 saves a PreTrainedTokenizerFast as "TokenizersBackend").
_EXACT_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The tokenizer in ``path`` as its ``tokenizer_config.json`` names it."""
    import transformers

    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            declared = json.load(f).get("tokenizer_class")
    except (OSError, json.JSONDecodeError):
        declared = None
    if declared in _EXACT_CLASSES and hasattr(transformers, declared):
        return getattr(transformers, declared).from_pretrained(str(path))
    return transformers.AutoTokenizer.from_pretrained(str(path))
