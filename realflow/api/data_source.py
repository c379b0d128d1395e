"""Data sets as streams of :class:`SequenceBatch` samples, by the spec's format.

The runtime only sees sample ids, keys and tensors. This module maps a
:class:`~realflow.api.experiment.DatasetSpec` (a registered row format plus a path)
to the keys its samples carry and to the tokenized samples of one worker's shard:

* ``sft``: ``packed_input_ids`` (prompt + response + eos) and ``prompt_mask``
  (1 on prompt tokens), metadata ``answer``.
* ``prompt_answer``: ``packed_prompts`` (prompt tokens), metadata ``answer``.
"""
from __future__ import annotations

import torch

from realflow.api.batch import SequenceBatch
from realflow.api.dataset import PromptAnswerDataset, SFTDataset
from realflow.api.experiment import DatasetSpec

_KEYS = {
    "sft": ("packed_input_ids", "prompt_mask"),
    "prompt_answer": ("packed_prompts",),
}


def dataset_keys(spec: DatasetSpec) -> tuple[str, ...]:
    """The tensor keys every sample of ``spec`` carries (the graph's data set keys)."""
    try:
        return _KEYS[spec.format]
    except KeyError:
        raise ValueError(
            f"data set format '{spec.format}' has no sample keys defined (known: {sorted(_KEYS)})"
        ) from None


def load_dataset_shard(spec: DatasetSpec, tokenizer, rank: int, world: int) -> list[SequenceBatch]:
    """Tokenize ``spec`` and return shard ``rank`` of ``world`` as one-sample batches."""
    args = dict(spec.args)
    max_prompt_len = int(args.pop("max_prompt_len", 1024))
    seed = int(args.pop("seed", 0))
    if spec.format == "sft":
        ds = SFTDataset.load(spec.path, tokenizer, max_prompt_len, args.pop("max_seq_len", None), seed=seed)
        shard = ds.shard(rank, world)
        return [
            SequenceBatch(
                ids=[s.id],
                seqlens={"packed_input_ids": [[len(s.input_ids)]], "prompt_mask": [[len(s.input_ids)]]},
                data={
                    "packed_input_ids": torch.tensor(s.input_ids, dtype=torch.long),
                    "prompt_mask": torch.tensor(s.prompt_mask, dtype=torch.bool),
                },
                metadata={"answer": [s.answer]},
            )
            for s in shard
        ]
    if spec.format == "prompt_answer":
        ds = PromptAnswerDataset.load(spec.path, tokenizer, max_prompt_len, seed=seed)
        shard = ds.shard(rank, world)
        return [
            SequenceBatch(
                ids=[s.id],
                seqlens={"packed_prompts": [[len(s.prompt_ids)]]},
                data={"packed_prompts": torch.tensor(s.prompt_ids, dtype=torch.long)},
                metadata={"answer": [s.answer]},
            )
            for s in shard
        ]
    dataset_keys(spec)  # raises the clear error for unknown formats
    raise AssertionError("unreachable")
