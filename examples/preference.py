"""Preference pairs for the examples ``reward_model`` and ``dpo``: the data, its format and
its data source, written against realflow's public API like any user's.

Data: built locally from the arithmetic task (no downloads). Each pair is one prompt with
the correct worked solution (``chosen``: the answer's digits reversed, then ``#### answer``)
and a near miss (``rejected``). Half the near misses are worked consistently to a wrong
answer, so only the arithmetic tells them apart (``68 #### 86``); the other half copy the
right working to a wrong final line (``58 #### 86``), a mistake visible from the text --
as in real preference data, some errors are easier to spot than others::

    {"id": "train-000017", "prompt": "47+38=", "chosen": "58 #### 85", "rejected": "58 #### 86"}

Format ``preference`` (rows: ``prompt``, ``chosen``, ``rejected``, optionally ``ref_logps``:
a reference model's summed response log-probs ``[chosen, rejected]``, which DPO's held-out
evaluation reads; bad rows are reported with file and line like any data set) and data
source ``preference``: every row becomes one sample of two sequences in
``packed_input_ids`` -- prompt + chosen + eos, then prompt + rejected + eos -- with
``prompt_mask`` marking the prompt tokens of both, and metadata ``ref_logps`` (None if absent).
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Any, Optional

import torch

from experiments.tasks.arithmetic import generate_splits, solution_text
from realflow.api.batch import SequenceBatch
from realflow.data.source import register_data_source
from realflow.data.dataset import DATASET_FORMATS

PAIR_KEYS = ("packed_input_ids", "prompt_mask")


@dataclass(frozen=True)
class PreferenceRow:
    id: str
    prompt: str
    chosen: str
    rejected: str
    ref_logps: Optional[tuple[float, float]] = None


@DATASET_FORMATS.register("preference")
def parse_preference(raw: dict) -> PreferenceRow:
    fields = []
    for key in ("prompt", "chosen", "rejected"):
        v = raw[key]  # a missing key is reported as "path:line: missing field ..."
        if not isinstance(v, str) or not v:
            raise ValueError(f"field {key!r} must be a non-empty string, got {v!r}")
        fields.append(v)
    if fields[1] == fields[2]:
        raise ValueError("'chosen' and 'rejected' are the same text")
    ref = raw.get("ref_logps")
    if ref is not None:
        if (not isinstance(ref, list) or len(ref) != 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in ref)):
            raise ValueError(f"field 'ref_logps' must be two numbers [chosen, rejected], got {ref!r}")
        ref = (float(ref[0]), float(ref[1]))
    return PreferenceRow("", *fields, ref_logps=ref)


def pair_token_ids(tokenizer: Any, prompt: str, responses: tuple[str, str]) -> tuple[list[int], list[list[int]]]:
    """(prompt ids, [prompt + response + eos for each response]): how every consumer tokenizes a pair."""
    p = list(tokenizer(prompt)["input_ids"])
    return p, [p + list(tokenizer(r, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
               for r in responses]


@register_data_source("preference", keys=PAIR_KEYS + ("ref_logps",), args=("max_seq_len",))
def pair_sample(row: PreferenceRow, tokenizer: Any, args: dict[str, Any]) -> Optional[SequenceBatch]:
    """Two sequences (chosen, rejected) sharing the prompt's tokens; None when one is too long."""
    prompt, seqs = pair_token_ids(tokenizer, row.prompt, (row.chosen, row.rejected))
    if max(map(len, seqs)) > int(args.get("max_seq_len", 256)):
        return None
    mask = [i < len(prompt) for s in seqs for i in range(len(s))]
    return SequenceBatch(ids=[row.id], seqlens={k: [[len(s) for s in seqs]] for k in PAIR_KEYS},
                         data={"packed_input_ids": torch.tensor(seqs[0] + seqs[1], dtype=torch.long),
                               "prompt_mask": torch.tensor(mask, dtype=torch.bool)},
                         metadata={"ref_logps": [None if row.ref_logps is None else list(row.ref_logps)]})


def wrong_answer(answer: int, rng: random.Random) -> int:
    """A near miss, as a model would make: one digit off, or off by a small amount."""
    if rng.random() < 0.5 and abs(answer) >= 10:
        digits = list(str(abs(answer)))
        i = rng.randrange(len(digits))
        digits[i] = str((int(digits[i]) + rng.choice([1, 2, 8, 9])) % 10)
        wrong = int("".join(digits)) * (-1 if answer < 0 else 1)
        if wrong != answer:
            return wrong
    return answer + rng.choice([-3, -2, -1, 1, 2, 3])


def make_pairs(rows: list[dict], seed: int, prefix: str, copy_error_share: float = 0.5) -> list[dict]:
    """A pair per arithmetic row; ``copy_error_share`` of the rejected keep the right working."""
    rng = random.Random(f"pairs:{seed}:{prefix}")
    out = []
    for i, r in enumerate(rows):
        chosen = solution_text(r["answer"])
        wrong = str(wrong_answer(int(r["answer"]), rng))
        if rng.random() < copy_error_share:
            rejected = chosen.split("####")[0] + "#### " + wrong
        else:
            rejected = solution_text(wrong)
        out.append({"id": f"{prefix}-{i:06d}", "prompt": r["prompt"], "chosen": chosen, "rejected": rejected})
    return out


def ensure_pairs(out_dir: str, n_train: int, n_test: int, seed: int, difficulty: int) -> tuple[str, str]:
    """(train, test) jsonl of preference pairs under ``out_dir`` (written once per parameters)."""
    train_p, test_p = os.path.join(out_dir, "train.jsonl"), os.path.join(out_dir, "test.jsonl")
    if os.path.isfile(train_p) and os.path.isfile(test_p):
        return train_p, test_p
    os.makedirs(out_dir, exist_ok=True)
    train, test = generate_splits(n_train, n_test, seed, difficulty)
    for path, rows, prefix in ((test_p, test, "test"), (train_p, train, "train")):
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(p) + "\n" for p in make_pairs(rows, seed, prefix))
        os.replace(tmp, path)
    return train_p, test_p
