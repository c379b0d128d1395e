"""A tiny word-level tokenizer with Qwen2.5-VL's vision markup, for the generated image tasks.

Why word-level: the image tasks' text is a handful of fixed words (a question, a digit, the
``####`` answer mark), so a fixed vocabulary of whole words is exact, needs no corpus and no
training, and keeps the embedding small for a CPU model. Digits are single tokens. The vision
tokens are Qwen2.5-VL's (``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``, plus
``<|video_pad|>`` that its config names), so realflow's data layer and transformers' Qwen2.5-VL
model treat this tokenizer exactly like the real one.

The chat template renders ``{"type": "image"}`` (and ``image_url``) content parts as
``<|vision_start|><|image_pad|><|vision_end|>`` and text parts as their text, as Qwen2.5-VL's
does; every turn ends with ``<|im_end|>``, the EOS, so a trained assistant turn stops there.
Decoding joins words with single spaces, so ``#### 3`` round-trips and the ``arithmetic``
reward (the integer after the last ``####``) reads it.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer, models, pre_tokenizers, processors

PAD, BOS, EOS, UNK = "<pad>", "<s>", "<|im_end|>", "<unk>"
IM_START = "<|im_start|>"
VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, IM_START, VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD]
BASE_WORDS = ["system", "user", "assistant", "####", "?", ".", ","] + [str(d) for d in range(10)]
VL_TOKENIZER_VERSION = 1
MANIFEST = "realflow_tokenizer_manifest.json"

VL_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + ' ' -}}"
    "{%- if m['content'] is string -%}{{- m['content'] -}}"
    "{%- else -%}{%- for p in m['content'] -%}"
    "{%- if p['type'] == 'image' or p['type'] == 'image_url' or 'image' in p -%}"
    "{{- ' <|vision_start|><|image_pad|><|vision_end|> ' -}}"
    "{%- elif p['type'] == 'text' -%}{{- p['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- ' <|im_end|> ' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant ' -}}{%- endif -%}"
)


def build_vl_tokenizer(words: Sequence[str]) -> Tokenizer:
    """A word-level tokenizer over ``SPECIAL_TOKENS + BASE_WORDS + words`` (ids in that order)."""
    vocab: dict[str, int] = {}
    for w in [*SPECIAL_TOKENS, *BASE_WORDS, *words]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, vocab[BOS])])
    return tok


def _save_hf(tok: Tokenizer, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
                                 model_max_length=4096, padding_side="left", clean_up_tokenization_spaces=False)
    hf.chat_template = VL_CHAT_TEMPLATE
    hf.save_pretrained(str(out))
    cfg_p = out / "tokenizer_config.json"
    cfg = json.loads(cfg_p.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # loads in transformers 4.x and 5.x alike
    cfg_p.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def ensure_vl_tokenizer(out_dir: str | os.PathLike, words: Sequence[str]) -> str:
    """Write the tokenizer of ``words`` under ``out_dir`` unless its manifest shows the same one
    is there (built aside and renamed into place, so a reader never sees half of it)."""
    out = Path(out_dir)
    params = {"version": VL_TOKENIZER_VERSION, "words": list(words)}
    try:
        if json.loads((out / MANIFEST).read_text()) == params and (out / "tokenizer.json").exists():
            return str(out)
    except (OSError, json.JSONDecodeError):
        pass
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _save_hf(build_vl_tokenizer(words), tmp)
        (tmp / MANIFEST).write_text(json.dumps(params, indent=1))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


__all__ = ["build_vl_tokenizer", "ensure_vl_tokenizer", "VL_CHAT_TEMPLATE", "SPECIAL_TOKENS", "BASE_WORDS",
           "PAD", "BOS", "EOS", "UNK", "VISION_START", "IMAGE_PAD", "VISION_END", "VIDEO_PAD"]
