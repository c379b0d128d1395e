"""A small byte-level BPE tokenizer trained offline on the task's own text.

Why train one: no downloads are possible, and a tiny model wants a tiny
vocabulary (the embedding would otherwise dominate its parameters). Digits
are always single tokens: a number then reads the same wherever it appears,
which is what lets a small model learn carries, and it keeps the answer's
tokens aligned for exact-match rewards.

The result is an ordinary Hugging Face tokenizer directory, so
``transformers.AutoTokenizer.from_pretrained(dir)`` loads it, and so does
every later stage (SFT, PPO, evaluation, export).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import string
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from realflow.data.dataset import read_jsonl

TOKENIZER_VERSION = 2
BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]  # ids 0..3, in this order
# Text fields read from jsonl corpora, in the order they are looked for.
TEXT_FIELDS = ("prompt", "solution", "response", "completion")
MANIFEST = "realflow_tokenizer_manifest.json"


def _corpus_lines(paths: Sequence[str | os.PathLike]) -> Iterator[str]:
    """Texts to learn merges from: chosen fields of jsonl rows, or raw lines."""
    for path in paths:
        if str(path).endswith(".jsonl"):
            for _, row in read_jsonl(path):  # a bad line raises "path:line: reason"
                yield from (row[k] for k in TEXT_FIELDS if isinstance(row.get(k), str))
            continue
        with open(path) as f:
            yield from (line.rstrip("\n") for line in f if line.strip())


def build_tokenizer(texts: Iterable[str], vocab_size: int = 160, extra_tokens: Sequence[str] = ()) -> Tokenizer:
    """Train the BPE model on ``texts``.

    The initial alphabet is all printable ASCII, so any ASCII text encodes
    without ``<unk>`` even if the corpus never showed a character. ``extra_tokens``
    (markup such as ``<tool_call>``) are added whole: text splits around them, so a
    string tokenizes the same alone and inside a longer text, and decoding keeps them.
    """
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # ASCII characters as the byte-level pre-tokenizer renders them (space -> 'Ġ', ...).
    ascii_chars = "".join(ch for ch in string.printable if ch not in "\r\x0b\x0c")
    alphabet = [p for p, _ in pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
                .pre_tokenize_str(ascii_chars)]
    initial = sorted(set("".join(alphabet)))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=SPECIAL_TOKENS, initial_alphabet=initial,
                                  max_token_length=8)
    tok.train_from_iterator(texts, trainer=trainer)
    if extra_tokens:
        tok.add_tokens(list(extra_tokens))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tok


def _save_hf(tok: Tokenizer, out_dir: Path) -> None:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                 pad_token=PAD, unk_token=UNK, model_max_length=4096,
                                 padding_side="left", clean_up_tokenization_spaces=False)
    hf.save_pretrained(str(out_dir))
    # transformers 5 records its new class name; the classic one loads in 4.x and 5.x
    # alike (serving stacks often pin 4.x), so write that instead.
    cfg_p = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_p.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_p.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def _fingerprint(paths: Sequence[str | os.PathLike]) -> list[str]:
    return [hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths]


def _is_current(out: Path, params: dict) -> bool:
    try:
        man = json.loads((out / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return man == params and (out / "tokenizer.json").exists()


def ensure_tokenizer(out_dir: str | os.PathLike, corpus_paths: Sequence[str | os.PathLike],
                     vocab_size: int = 160, extra_tokens: Sequence[str] = ()) -> str:
    """Train and save the tokenizer under ``out_dir`` unless its manifest shows it
    was already made from the same corpus bytes and settings. Returns ``out_dir``.

    The directory is built aside and renamed into place, so a reader never sees
    a half-written tokenizer. Training is deterministic, so when several workers
    race, whichever copy lands is the same; still, call it once before starting
    workers where you can.
    """
    out = Path(out_dir)
    params = {"version": TOKENIZER_VERSION, "vocab_size": vocab_size,
              **({"extra_tokens": list(extra_tokens)} if extra_tokens else {}),
              "corpus_sha256": _fingerprint(corpus_paths)}
    if _is_current(out, params):
        return str(out)
    tok = build_tokenizer(_corpus_lines(corpus_paths), vocab_size=vocab_size, extra_tokens=extra_tokens)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _save_hf(tok, tmp)
    (tmp / MANIFEST).write_text(json.dumps(params, indent=1))
    try:
        if _is_current(out, params):  # another process finished first
            return str(out)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    except OSError:
        if not _is_current(out, params):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


__all__ = ["build_tokenizer", "ensure_tokenizer", "BOS", "EOS", "PAD", "UNK", "SPECIAL_TOKENS"]
