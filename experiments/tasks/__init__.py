"""Synthetic, verifiable tasks generated locally.

The default experiments train from scratch on CPU with no downloads, so the
data set and the tokenizer are produced here, deterministically from a seed,
and cached on disk next to a manifest that says how they were made.
"""
from experiments.tasks.arithmetic import ArithmeticDataset, ensure_dataset, generate_splits
from experiments.tasks.tokenizer import ensure_tokenizer

__all__ = ["ArithmeticDataset", "ensure_dataset", "generate_splits", "ensure_tokenizer"]
