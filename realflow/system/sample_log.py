"""The first samples of every train step, as the trainer saw them: ``<run dir>/samples/<mfc>.jsonl``.

Why: the question a new user asks first -- "what did my model actually get?" (was the chat
template applied, was the system prompt there, what did it answer, what was it rewarded) -- is
answered by the token ids the trainer trained on, not by the data file. ``log_samples=N`` writes
the first N samples of every train step's batch on the data-parallel head of each train MFC: one
JSON line per sample with the step, the sample id, and per sequence its token ids, how many of
them are prompt, the decoded prompt and answer, and the per-sequence scalars the batch carries
(rewards, ...). The generation servers log the requests they answer the same way (see
:mod:`realflow.rollout.request_log`), so the two can be compared id for id.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional

import torch

from realflow.api.batch import SequenceBatch
from realflow.api.keys import INPUT_IDS, PROMPT_MASK

SAMPLES_DIR = "samples"


def samples_dir(run_dir: str) -> str:
    return os.path.join(run_dir, SAMPLES_DIR)


def _plain(value: Any) -> Any:
    """A JSON-able copy of a metadata value (anything else becomes its str: a log never stops a run)."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


def sample_records(batch: SequenceBatch, n: int, decode: Optional[Callable[[list[int]], str]] = None) -> list[dict]:
    """The records of the first ``n`` samples of ``batch`` (see the module docstring)."""
    if INPUT_IDS not in batch.data or batch.data[INPUT_IDS] is None:
        return []
    scalars = [k for k, per in batch.seqlens.items()  # one value per sequence: rewards, masks, ...
               if k not in (INPUT_IDS, PROMPT_MASK) and batch.data[k] is not None
               and all(x == 1 for lens in per for x in lens)]
    records = []
    for i, sid in enumerate(batch.ids[:n]):
        seqs = []
        masks = batch.sequences(PROMPT_MASK, i) if PROMPT_MASK in batch.data else None
        values = {k: batch.sequences(k, i) for k in scalars}
        for j, ids_t in enumerate(batch.sequences(INPUT_IDS, i)):
            ids = ids_t.tolist()
            seq: dict[str, Any] = {"input_ids": ids}
            if masks is not None:
                seq["prompt_len"] = int(masks[j].to(torch.int64).sum())
            if decode is not None:
                cut = seq.get("prompt_len", 0)
                seq["prompt"], seq["answer"] = decode(ids[:cut]), decode(ids[cut:])
            for k, v in values.items():
                seq[k] = v[j].reshape(-1)[0].item()
            seqs.append(seq)
        rec: dict[str, Any] = {"id": sid, "sequences": seqs}
        if batch.metadata:  # e.g. the reference answer
            rec["metadata"] = {k: _plain(vals[i]) for k, vals in batch.metadata.items()}
        records.append(rec)
    return records


class TrainSampleLog:
    """Appends the first ``n`` samples of each train step of an MFC to ``<dir>/<mfc>.jsonl``."""

    def __init__(self, directory: str, n: int, tokenizer_of: Callable[[str], Any]) -> None:
        self.directory, self.n = directory, n
        self._tokenizer_of = tokenizer_of  # model name -> tokenizer (or None): decoded text beside the ids
        self._decoders: dict[str, Optional[Callable[[list[int]], str]]] = {}

    def _decoder(self, model_name: str) -> Optional[Callable[[list[int]], str]]:
        if model_name not in self._decoders:
            tok = self._tokenizer_of(model_name)
            self._decoders[model_name] = None if tok is None else (
                lambda ids: tok.decode(ids, skip_special_tokens=False))
        return self._decoders[model_name]

    def write(self, mfc_name: str, model_name: str, step: int, batch: SequenceBatch) -> None:
        records = sample_records(batch, self.n, self._decoder(model_name))
        if not records:
            return
        os.makedirs(self.directory, exist_ok=True)
        with open(os.path.join(self.directory, f"{mfc_name}.jsonl"), "a") as f:
            for rec in records:
                f.write(json.dumps({"step": step, **rec}) + "\n")
