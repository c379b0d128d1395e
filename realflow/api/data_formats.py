"""The data-set contract: what a ``DatasetSpec.format`` names, and what its rows become.

A data set in a run is a :class:`~realflow.api.experiment.DatasetSpec`: a *format* (a name
in :data:`DATASET_FORMATS`) and a path. A format is a parser ``raw row (dict) -> typed row``:
a :class:`PromptAnswerRow` (RL prompts with a reference answer) or an :class:`SFTRow`
(prompt + target response), raising :class:`RowInvalid` with a short reason. A format whose
rows are neither registers a :class:`DataSource` too (:func:`register_data_source`): the keys
its samples carry and how a row becomes a sample.

The machinery -- reading files, the built-in formats, chat rendering, tokenising and
sharding -- is :mod:`realflow.data`; users register formats here, or through it (it
re-exports these names).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from realflow.api.batch import SequenceBatch
from realflow.api.registry import Registry

__all__ = ["Messages", "PromptAnswerRow", "SFTRow", "RowInvalid", "RowParser", "DATASET_FORMATS",
           "DataSource", "DATA_SOURCES", "register_data_source"]

Messages = list  # of {"role": str, "content": str}


@dataclass(frozen=True)
class PromptAnswerRow:
    """A prompt to generate from (text, or ``{role, content}`` messages) and the reference
    final answer (RL data). ``images``: the prompt's images as encoded bytes, in the order of
    its ``<image>`` placeholders (filled in by the loader, :mod:`realflow.data.images`)."""
    id: str
    prompt: Union[str, Messages]
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)
    images: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class SFTRow:
    """A prompt and the target response (SFT data); ``answer`` if one can be read off.
    ``messages``, when set, is the whole conversation to train on (its assistant turns are
    the targets); ``prompt``/``response`` then hold its first prompt and last reply.
    ``images``: as :class:`PromptAnswerRow`'s (placeholders in the prompt or the conversation)."""
    id: str
    prompt: Union[str, Messages]
    response: str
    answer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    messages: Optional[Messages] = None
    images: tuple[bytes, ...] = ()


class RowInvalid(ValueError):
    """Raised by a format parser; the loader adds ``path:line``."""


# A format turns a raw row (a dict) into a typed row, raising RowInvalid (or
# ValueError/TypeError) with a short reason. ``id`` is filled in by the loader.
RowParser = Callable[[dict], "PromptAnswerRow | SFTRow"]
DATASET_FORMATS: Registry[RowParser] = Registry("data set format")


@dataclass(frozen=True)
class DataSource:
    """How rows of a user format become samples: ``keys`` (tensor keys and metadata keys every
    sample carries), ``to_sample`` and the extra ``spec.args`` it accepts."""
    keys: tuple[str, ...]
    to_sample: Callable[[Any, Any, dict[str, Any]], Optional[SequenceBatch]]
    args: tuple[str, ...] = ()


DATA_SOURCES: Registry[DataSource] = Registry("data source")


def register_data_source(name: str, keys: tuple[str, ...], args: tuple[str, ...] = ()):
    """Decorate ``to_sample(row, tokenizer, args) -> SequenceBatch | None`` (``row``: what the
    ``DATASET_FORMATS`` parser of the same name returned, with its ``id``; ``args``: the
    spec's args minus ``seed``/``skip_bad_rows``) to make format ``name`` a data source."""
    if not keys or not all(isinstance(k, str) and k for k in keys):
        raise ValueError(f"data source {name!r}: keys must be non-empty strings, got {keys!r}")

    def decorator(fn: Callable[[Any, Any, dict[str, Any]], Optional[SequenceBatch]]):
        DATA_SOURCES.register(name, DataSource(tuple(keys), fn, tuple(args)))
        return fn
    return decorator
