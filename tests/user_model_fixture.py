"""A user's model, built offline: a Qwen-format chat tokenizer, a tiny Qwen2 checkpoint, and
the Hugging Face hub cache layout that ``hf download`` would leave on disk.

Why: tests cannot download Qwen, but the code that takes a user's model must be proven on
files shaped exactly like the real ones (tokenizer.json + ChatML template, safetensors,
``models--org--name/{blobs,snapshots,refs}``), not on hand-rolled stand-ins.  Plain
functions, so any test module can build what it needs into its own tmp dir; for several
modules sharing one model per session see :func:`shared_chat_model`.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
TOKENIZER_VOCAB = 384  # 256 byte symbols + 3 specials + merges

# Qwen2's pre-tokenizer split (transformers' models/qwen2/tokenization_qwen2.py): digits one
# by one, so arithmetic prompts tokenize the way they do for the real models.
QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                           r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

_SYSTEM = "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
_ASSISTANT_PLAIN = "{{- message['content'] + '<|im_end|>' }}"
_ASSISTANT_MASKED = "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"


def chatml_template(assistant_mask: bool = False) -> str:
    """Qwen2.5's ChatML layout: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message,
    ``<|im_start|>assistant\\n`` as the generation prompt, a system message only when given
    (Qwen2.5 would insert a default one; a fixed prompt is easier to assert on).

    ``assistant_mask`` wraps each assistant reply AND its ``<|im_end|>`` in transformers'
    ``{% generation %}`` markers, so ``apply_chat_template(..., return_assistant_tokens_mask=True)``
    marks exactly the tokens SFT trains on (the model must learn to emit the stop token).
    Real Qwen templates have no markers, so they are off by default.
    """
    assistant = _ASSISTANT_MASKED if assistant_mask else _ASSISTANT_PLAIN
    return (
        "{%- for message in messages %}"
        "{%- if message['role'] == 'assistant' %}"
        "{{- '<|im_start|>assistant\\n' }}" + assistant + "{{- '\\n' }}"
        "{%- else %}" + _SYSTEM + "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


def _corpus() -> list[str]:
    """English, digits and ChatML markup: enough for merges that look like a real vocab."""
    english = [
        "The quick brown fox jumps over the lazy dog.",
        "You are a helpful assistant. Answer the question step by step.",
        "What is the sum of the two numbers? The answer is the total.",
        "Please write a short story about a robot who learns to count.",
        "She said that they would think about it, and then they went home.",
        "Reinforcement learning trains a policy to maximise its reward.",
    ]
    digits = [f"{a} + {b} = {a + b}" for a in range(0, 100, 7) for b in range(3, 60, 11)]
    chat = [f"{IM_START}system\nYou are a helpful assistant.{IM_END}\n"
            f"{IM_START}user\n{q}{IM_END}\n{IM_START}assistant\n{a}{IM_END}\n"
            for q, a in [("What is 12 + 30?", "12 + 30 = 42"), ("Say hello.", "Hello! How can I help?")]]
    return (english + digits + chat) * 4


def build_chat_tokenizer_object(vocab_size: int = TOKENIZER_VOCAB) -> Tokenizer:
    """A byte-level BPE laid out like Qwen2's tokenizer.json (NFC, Qwen's split regex,
    byte-level, no unk), so transformers' ``Qwen2Tokenizer`` and ``PreTrainedTokenizerFast``
    read it to the same ids."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    return tok


def make_chat_tokenizer(out_dir: str, assistant_mask: bool = False,
                        tokenizer_class: str | None = "Qwen2Tokenizer") -> str:
    """Save a fast ChatML tokenizer (eos ``<|im_end|>``, pad ``<|endoftext|>``, no bos, as
    Qwen2.5-Instruct) to ``out_dir``; returns ``out_dir``.  See :func:`chatml_template`.

    ``tokenizer_config.json`` declares ``tokenizer_class`` as a Qwen2.5 download does
    (transformers 5 itself would write ``TokenizersBackend``; None keeps that), so loaders
    see what a user's model looks like; the tokenizer reads to the same ids either way.
    """
    import json

    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=build_chat_tokenizer_object(),
        eos_token=IM_END, pad_token=ENDOFTEXT, unk_token=None, bos_token=None,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=chatml_template(assistant_mask),
        model_max_length=256,
    )
    os.makedirs(out_dir, exist_ok=True)
    tok.save_pretrained(out_dir)
    if tokenizer_class is not None:
        cfg_path = os.path.join(out_dir, "tokenizer_config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg["tokenizer_class"] = tokenizer_class
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
    return str(out_dir)


def make_qwen2_checkpoint(out_dir: str, tokenizer_dir: str, seed: int = 0, **arch: Any) -> str:
    """Save a seeded random tiny ``Qwen2ForCausalLM`` (safetensors, fp32) plus a copy of the
    tokenizer files to ``out_dir``; returns ``out_dir``.  ``arch`` overrides Qwen2Config
    fields; vocab and bos/eos/pad ids come from the tokenizer."""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    fields: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                                  vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    fields.update(arch)
    config = Qwen2Config(**fields)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float().eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    for name in sorted(os.listdir(tokenizer_dir)):  # the files as written, not a re-save
        src = os.path.join(tokenizer_dir, name)
        if os.path.isfile(src) and name not in ("config.json", "generation_config.json"):
            shutil.copyfile(src, os.path.join(out_dir, name))
    return str(out_dir)


def _blob_name(path: str) -> str:
    """The hub's blob name: sha256 for LFS files (weights), the git blob sha1 otherwise."""
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf")):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def make_hub_cache(cache_dir: str, repo_id: str, checkpoint_dir: str, revision_name: str = "main") -> str:
    """Lay ``checkpoint_dir`` out as huggingface_hub's cache would after downloading
    ``repo_id`` at branch ``revision_name``; returns the snapshot directory.

    ``models--org--name/blobs/<hash>`` holds the bytes, ``snapshots/<commit>/<path>`` are
    relative symlinks to them, ``refs/<revision_name>`` holds the commit (a 40-hex hash of
    the contents, so the same files give the same commit).  Call again with another
    checkpoint and branch to add a second revision to the same repo.
    """
    files = sorted(os.path.relpath(os.path.join(d, f), checkpoint_dir)
                   for d, _, fs in os.walk(checkpoint_dir) for f in fs)
    blobs = {rel: _blob_name(os.path.join(checkpoint_dir, rel)) for rel in files}
    commit = hashlib.sha1(("\n".join(f"{rel} {blobs[rel]}" for rel in files) + repo_id).encode()).hexdigest()
    repo = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", commit)
    for rel in files:
        blob = os.path.join(repo, "blobs", blobs[rel])
        os.makedirs(os.path.dirname(blob), exist_ok=True)
        if not os.path.exists(blob):
            shutil.copyfile(os.path.join(checkpoint_dir, rel), blob)
        link = os.path.join(snapshot, rel)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        if not os.path.lexists(link):
            os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    ref = os.path.join(repo, "refs", revision_name)
    os.makedirs(os.path.dirname(ref), exist_ok=True)
    with open(ref, "w") as f:
        f.write(commit)  # no newline, as huggingface_hub writes it
    return snapshot


def make_unsupported_checkpoint(out_dir: str, checkpoint_dir: str | None = None,
                                architecture: str = "MambaForCausalLM", model_type: str = "mamba") -> str:
    """A complete checkpoint (weights, tokenizer) whose config.json names an architecture
    realflow cannot build: a copy of ``checkpoint_dir``, or a fresh tiny one when None;
    returns ``out_dir``.  Only the config lies, so a check that passes must be reading it."""
    import json

    if checkpoint_dir is not None:
        shutil.copytree(checkpoint_dir, out_dir, dirs_exist_ok=True)
    else:
        tok_dir = make_chat_tokenizer(os.path.join(out_dir, ".tokenizer"))
        make_qwen2_checkpoint(out_dir, tok_dir)
        shutil.rmtree(tok_dir)
    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    config.update(architectures=[architecture], model_type=model_type)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return str(out_dir)


_SHARED: dict[str, tuple[str, str]] = {}


def shared_chat_model(tmp_path_factory: Any) -> tuple[str, str]:
    """(tokenizer_dir, checkpoint_dir) built once per pytest session (the tokenizer has
    ``assistant_mask=True``); treat both as read-only."""
    key = str(tmp_path_factory.getbasetemp())
    if key not in _SHARED:
        root = tmp_path_factory.mktemp("user_model")
        tok_dir = make_chat_tokenizer(str(root / "tokenizer"), assistant_mask=True)
        _SHARED[key] = tok_dir, make_qwen2_checkpoint(str(root / "qwen2_tiny"), tok_dir)
    return _SHARED[key]
