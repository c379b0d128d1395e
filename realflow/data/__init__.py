"""Data sets: the files users bring, turned into tokenised, sharded samples.

* :mod:`.readers` -- jsonl, json, parquet and saved ``datasets`` directories, row by row
  with where each row came from;
* :mod:`.rows` -- the built-in row formats (plain fields, GSM8K, boxed, SFT, messages) and
  field mappings;
* :mod:`.images` -- a row's images (paths, base64, data URLs, parquet bytes) read and checked,
  and matched to the prompt's ``<image>`` placeholders or image content parts;
* :mod:`.chat_render` -- prompts and conversations to token ids, the one rendering the
  trainer, the evaluation, the rollout workers and the agents' proxy share
  (:mod:`.image_render`: the same for rows with images, image tokens expanded);
* :mod:`.dataset` -- tokenised, shardable data sets and what the length limits drop;
* :mod:`.source` -- a ``DatasetSpec`` to the keys its samples carry and one worker's shard
  of ``SequenceBatch`` samples.

The contract (the format registry, the typed rows, user data sources) is
:mod:`realflow.api.data_formats`. This package imports ``realflow.api`` and ``realflow.base``
only; the model workers, the rollout workers and the experiments use it.
"""
