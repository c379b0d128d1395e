"""The names of the batch keys that more than one module reads or writes: one definition each.

Why one module: a key is a contract between the MFC that produces it and every MFC, runtime
part or log that consumes it (the generation MFC writes ``packed_logprobs``, the trainer reads
it, the sample log prints ``packed_input_ids``). Spelled in several modules, a renamed key
breaks silently (a missing key is found only when a run reaches it). It lives in
``realflow/api`` because ``realflow/system`` and ``realflow/rollout`` use the keys too and
may not import ``mfc`` or ``graphs``.

Conventions of the per-token keys (aligned with ``packed_input_ids``) are in
:mod:`mfc.rl_batch`.
"""
from __future__ import annotations

__all__ = ["PROMPTS", "ANSWER", "INPUT_IDS", "PROMPT_MASK", "LOGPROBS", "NO_EOS", "REWARDS", "REF_LOGPROBS",
           "PROX_LOGPROBS", "VALUES", "VERSIONS", "ROUTED_EXPERTS"]

#: the prompt's token ids (one sequence per sample), from the dataset
PROMPTS = "packed_prompts"
#: the reference answer of a prompt (metadata), from the dataset
ANSWER = "answer"
#: prompt + response token ids, packed (one sequence per response)
INPUT_IDS = "packed_input_ids"
#: True at the prompt's positions of ``packed_input_ids``
PROMPT_MASK = "prompt_mask"
#: the behaviour policy's log-prob of each next token (the generator's)
LOGPROBS = "packed_logprobs"
#: one value per response: 1 when it was cut by max_new_tokens (no end-of-sequence token)
NO_EOS = "seq_no_eos_mask"
#: one value per response: its reward
REWARDS = "rewards"
#: the reference model's log-probs (KL penalty)
REF_LOGPROBS = "packed_ref_logprobs"
#: the proximal policy's log-probs (the decoupled objective of asynchronous PPO)
PROX_LOGPROBS = "proximal_logprobs"
#: the critic's value per token
VALUES = "values"
#: the weight version that generated each token (asynchronous rollouts)
VERSIONS = "packed_versions"
#: MoE models (routing replay, R3): the generator's top-k expert ids per token and layer,
#: ``[tokens, num_layers, topk]`` uint8 (int16 beyond 256 experts), aligned with ``packed_input_ids``
#: (row t = token t's experts; see :func:`realflow.api.routing.routed_experts_tensor`)
ROUTED_EXPERTS = "routed_experts"
