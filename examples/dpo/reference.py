"""The reference model's response log-probs of held-out pairs, computed once with transformers.

Why here: DPO's held-out metrics compare the policy with the frozen reference, but an
evaluation call only sees the policy. The reference never changes, so its sums are
computed once, before the run (``prepare``), and stored in the held-out rows as
``ref_logps`` -- tokenized exactly as the data source tokenizes (``pair_token_ids``).
"""
from __future__ import annotations

import json
import os

import torch

from examples.preference import pair_token_ids


@torch.no_grad()
def response_logp(model, ids: list[int], n_prompt: int) -> float:
    """Sum of log p(token) over the response tokens (and eos) of one sequence."""
    x = torch.tensor([ids])
    logp = torch.log_softmax(model(x).logits[0].float(), dim=-1)
    targets = x[0, n_prompt:]
    return float(logp[n_prompt - 1:-1].gather(1, targets[:, None]).sum())


def write_with_reference(checkpoint: str, pairs_path: str, out_path: str) -> str:
    """``pairs_path`` with each row's ``ref_logps`` under ``checkpoint``, written to ``out_path``
    (kept when already there and newer than both inputs)."""
    if os.path.isfile(out_path) and os.path.getmtime(out_path) >= max(
            os.path.getmtime(pairs_path), os.path.getmtime(os.path.join(checkpoint, "config.json"))):
        return out_path
    from transformers import AutoModelForCausalLM

    from realflow.base.tokenizer_loading import load_tokenizer

    torch.set_num_threads(1)
    tok = load_tokenizer(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    rows = []
    with open(pairs_path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            prompt, seqs = pair_token_ids(tok, row["prompt"], (row["chosen"], row["rejected"]))
            row["ref_logps"] = [response_logp(model, s, len(prompt)) for s in seqs]
            rows.append(row)
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    tmp = f"{out_path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(tmp, out_path)
    return out_path
