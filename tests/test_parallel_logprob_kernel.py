"""The memory-lean log-prob (one saved softmax, gradient in place) equals plain autograd maths.

Single process (tp = 1); tensor-parallel shards are covered by the layout tests, whose losses
go through the same function (tests/test_parallel_lora.py: log-prob losses vs PEFT in t2/p2)."""
from __future__ import annotations

import pytest
import torch

from parallel.outputs import vocab_parallel_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_logprob_equals_autograd(temperature, dtype):
    g = torch.Generator().manual_seed(0)
    n, vocab, padded = 37, 100, 128  # padded columns must never enter the softmax
    logits = (torch.randn(n, padded, generator=g) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g)
    weights = torch.randn(n, generator=g)
    before = logits.detach().clone()
    lean = vocab_parallel_logprobs(logits, targets, None, 0, vocab, temperature=temperature)[0]
    (lean * weights).sum().backward()
    grad_lean = logits.grad.clone()
    logits.grad = None
    ref = torch.log_softmax(logits.float()[:, :vocab] / temperature, -1).gather(-1, targets[:, None])[:, 0]
    (ref * weights).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(lean, ref, atol=tol, rtol=0)
    assert torch.allclose(grad_lean.float(), logits.grad.float(), atol=tol, rtol=0)
    assert grad_lean.dtype == dtype and float(grad_lean[:, vocab:].abs().max()) == 0.0
    assert torch.equal(logits.detach(), before)  # the softmax is built in a copy, never in the logits
