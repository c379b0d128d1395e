"""The engine's sampling streams: counter-based uniforms, and the table it hashes them into.

Proves: :func:`parallel.generation.sampler.counter_uniform` is uniform (chi-square over 100
bins) with no correlation between adjacent draws of a stream nor between adjacent seeds (a
request's n samples have seeds base, base+1, ...); the engine's hashed-ahead table
(``RowsMixin._uniform``) gives exactly ``counter_uniform(seed, draw)`` at every step of real
generation, across table refills, rows leaving (the batch compacted) and rows joining.
"""
from __future__ import annotations

import pytest
import torch

from parallel.generation.sampler import counter_uniform, split_seed
from parallel.testing import make_tiny_hf
from realflow.api.generation import SamplingParams

torch.set_num_threads(1)


def _uniforms(seeds: torch.Tensor, draws: int) -> torch.Tensor:
    """[seeds, draws] uniforms of the streams seeded ``seeds`` (int64 >= 0)."""
    t = torch.arange(draws)[None, :].expand(len(seeds), -1)
    lo, hi = seeds & 0xFFFFFFFF, seeds >> 32
    return counter_uniform(lo[:, None].expand_as(t), hi[:, None].expand_as(t), t)


@pytest.mark.parametrize("base", [0, 2 ** 40 + 12345])
def test_counter_uniforms_are_uniform_and_uncorrelated(base):
    u = _uniforms(base + torch.arange(1000), 100)  # 100k draws
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    counts = torch.bincount((u * 100).long().flatten(), minlength=100).double()
    chi2 = float(((counts - 1000.0) ** 2 / 1000.0).sum())
    assert chi2 < 150.0, f"chi-square {chi2:.1f} on 99 degrees of freedom (p < 0.001 above 148)"
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:])):  # adjacent draws, adjacent seeds
        r = float(torch.corrcoef(torch.stack((a.flatten(), b.flatten())))[0, 1])
        assert abs(r) < 0.02, f"correlation {r:.3f}"


def test_split_seed_round_trips():
    for seed in (0, 1, 2 ** 32 - 1, 2 ** 32, 2 ** 62 + 7):
        lo, hi = split_seed(seed)
        assert (hi << 32) + lo == seed and 0 <= lo < 2 ** 32 and 0 <= hi < 2 ** 32


def test_engine_table_gives_every_draw_of_the_stream(tmp_path):
    """40 steps (the table holds 16 draws: refilled twice), rows of different lengths leave
    and a second request joins mid-run: at every step the engine's uniform of each running
    row is counter_uniform(its seed, its draw)."""
    from parallel.generation import EngineConfig, GenerationEngine

    make_tiny_hf(str(tmp_path), family="qwen2", seed=3)
    eng = GenerationEngine.from_hf(str(tmp_path), EngineConfig(max_running_requests=8))
    seeds = {}
    for rid, n, seed in (("a", 3, 2 ** 33 + 5), ("b", 2, 77)):
        sp = SamplingParams(max_new_tokens=40 if rid == "a" else 25, temperature=1.0, n=n, seed=seed,
                            ignore_eos=True)
        for i, r in enumerate(eng.add_request(rid, [5, 6, 7] if rid == "a" else [9, 10], sp)):
            seeds[r] = seed + i
        if rid == "a":
            for _ in range(6):
                eng.step()
    checked = 0
    while eng.has_work():
        B = eng.num_running
        if B:
            got = eng._uniform(slice(0, B))
            for row, seq in enumerate(eng._running[:B]):
                lo, hi = split_seed(seeds[seq.rid])
                want = counter_uniform(torch.tensor([lo]), torch.tensor([hi]), torch.tensor([len(seq.out)]))
                assert float(got[row]) == float(want[0]), (seq.rid, len(seq.out))
                checked += 1
        eng.step()
    assert checked >= 140  # (3 rows x ~34 steps + 2 rows x 25)
