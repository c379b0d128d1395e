"""The logged train-inference gap (``actor_train/mismatch/*``): ~0 when the generator is the trainer's
own weights in fp32, large and attributed when a known difference is injected.

One real megatron engine (one gloo process) trains a tiny Qwen2 through the real ``ppo_actor``
interface; the behaviour log-probs come from the real generation engine: the trainer's own
(sharing its parameters), a bf16 copy, a copy with one layer perturbed, or the previous
version's weights labelled as the current one. ``lr = 0`` except where the weights must move,
so every step compares the same weights. The system tests check the same stats in real runs
(tests/test_system_ppo.py, tests/test_system_async_ppo.py).
"""
from __future__ import annotations

import os

import pytest
import torch

from parallel.testing import make_tiny_hf, run_cases

MODULE = __name__.rsplit(".", 1)[-1]
PROMPTS = [[3, 17, 5, 9], [8, 2, 11], [4, 4, 20, 7, 1], [13, 6]]


class _NoEos:
    eos_token_id = None


def _setup(ctx, lr: float):
    from parallel.backend import MegatronBackend
    from parallel.groups import ParallelStrategy
    from realflow.api.experiment import ModelSpec, OptimizerConfig

    path = os.path.join(ctx.tmpdir, "lm")
    if "made" not in ctx.cache:
        make_tiny_hf(path, seed=3)
        ctx.cache["made"] = True
    backend = MegatronBackend()
    groups = ctx.cache.get("groups") or backend.build_groups([0], ParallelStrategy(1, 1, 1))
    ctx.cache["groups"] = groups
    eng = backend.build_engine(ModelSpec("actor", path, optimizer=OptimizerConfig(lr=lr, warmup_steps_proportion=0.0),
                                         total_train_steps=4), groups, 1)
    return path, eng


def _actor(decoupled: bool = False):
    from mfc.ppo_actor import PPOActorInterface

    return PPOActorInterface(max_new_tokens=8, n_samples=4, seed=7, decoupled=decoupled,
                             ppo={"n_minibatches": 1})


def _prompts():
    from realflow.api.batch import SequenceBatch
    from realflow.api.keys import PROMPTS as P

    return SequenceBatch.from_samples([f"p{i}" for i in range(len(PROMPTS))],
                                      {P: [torch.tensor(p) for p in PROMPTS]})


def _with_rewards(batch, versions: int | None = None):
    """The generated batch plus a reward per response (and each token's weight version)."""
    from realflow.api.batch import SequenceBatch
    from realflow.api.keys import INPUT_IDS, REWARDS, VERSIONS

    g = torch.Generator().manual_seed(1)
    data = {REWARDS: [[torch.tensor([float(torch.randint(0, 2, (1,), generator=g))])
                       for _ in batch.sequences(INPUT_IDS, i)] for i in range(len(batch))]}
    if versions is not None:
        data[VERSIONS] = [[torch.full((len(s),), versions, dtype=torch.int32) for s in batch.sequences(INPUT_IDS, i)]
                          for i in range(len(batch))]
    return batch.update_(SequenceBatch.from_samples(list(batch.ids), data))


def _generated_by(gen, batch):
    """``batch`` as the actor's generate MFC makes it, with ``gen`` (a generation engine) sampling."""
    from realflow.api.interface import Model

    class _Wrapped:  # the actor asks model.module for its generator: here, the given one
        def generator(self, *a, **k):
            return gen

    return _actor().generate(Model("actor", _Wrapped(), _NoEos(), 0), batch, _mb())


def _mb():
    from realflow.api.batch import MicroBatchSpec

    return MicroBatchSpec()


def _gap(stats: dict) -> dict:
    return {k[len("mismatch/"):]: v for k, v in stats.items() if k.startswith("mismatch/")}


def case_injected(ctx):
    from parallel.generation import GenerationEngine
    from realflow.api.interface import Model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    path, eng = _setup(ctx, lr=0.0)
    model = Model("actor", eng, _NoEos(), 0)
    out = {}
    # 1. the trainer's own generator (shared fp32 parameters): the gap is fp32 round-off
    batch = _with_rewards(_actor().generate(model, _prompts(), _mb()))
    out["own"] = _gap(_actor().train_step(model, batch, _mb()))
    # 2. a bf16 generator of the same weights
    bf16 = GenerationEngine.from_hf(path, dtype=torch.bfloat16, tokenizer=None)
    out["bf16"] = _gap(_actor().train_step(model, _with_rewards(_generated_by(bf16, _prompts())), _mb()))
    # 3. a generator whose copy of layer 1's MLP was perturbed (a corrupt weight update)
    hf = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        hf.model.layers[1].mlp.down_proj.weight.add_(0.05 * torch.randn_like(hf.model.layers[1].mlp.down_proj.weight))
    bad = os.path.join(ctx.tmpdir, "perturbed")
    hf.save_pretrained(bad)
    gen_bad = GenerationEngine.from_hf(bad, tokenizer=None)
    out["perturbed"] = _gap(_actor().train_step(model, _with_rewards(_generated_by(gen_bad, _prompts())), _mb()))
    # 4. staleness: the trainer moves to version 1; the generator still holds version 0's weights
    _, eng2 = _setup(ctx, lr=1e-2)
    m2 = Model("actor", eng2, _NoEos(), 0)
    old = GenerationEngine.from_hf(path, tokenizer=None)  # version 0's weights, kept apart
    warm = _with_rewards(_actor().generate(m2, _prompts(), _mb()))
    _actor().train_step(m2, warm, _mb())
    m2.version = 1
    for label, claimed in (("stale_honest", 0), ("stale_claims_current", 1)):
        b = _with_rewards(_generated_by(old, _prompts()), versions=claimed)
        actor = _actor(decoupled=True)
        b = b.update_(actor.inference(m2, b, _mb()))  # the proximal log-probs at version 1
        out[label] = _gap(actor.train_step(m2, b, _mb()))
    # the same with a generator of the current weights labelled current: offset 0 is ~0 again
    cur = _with_rewards(_actor().generate(m2, _prompts(), _mb()), versions=1)
    actor = _actor(decoupled=True)
    cur = cur.update_(actor.inference(m2, cur, _mb()))
    out["current"] = _gap(actor.train_step(m2, cur, _mb()))
    return out


@pytest.fixture(scope="module")
def gaps():
    res = run_cases([f"{MODULE}:case_injected"], world_size=1, timeout=400,
                    pythonpath=[os.path.dirname(os.path.abspath(__file__))])["case_injected"]
    assert res.ok, res.error
    return res.data[0]


def test_fp32_generator_sharing_the_trainers_weights_has_no_gap(gaps):
    g = gaps["own"]
    assert g["tokens"] > 50
    assert g["abs_mean"] <= 1e-5 and g["k3"] <= 1e-10, g
    assert g["frac_over_0.1"] == 0.0 and g["hist_0"] + g["hist_1"] == pytest.approx(1.0), g


def test_a_bf16_generator_shows_a_large_gap(gaps):
    g, own = gaps["bf16"], gaps["own"]
    assert g["abs_mean"] > 1000 * max(own["abs_mean"], 1e-8) and g["abs_mean"] > 1e-4, (g, own)
    # the per-token histogram moved from the fp32 round-off bins to the bf16 ones
    assert g["hist_0"] + g["hist_1"] < 0.5 and g["hist_3"] + g["hist_4"] + g["hist_5"] > 0.5, g


def test_a_perturbed_layer_shows_a_large_gap(gaps):
    g = gaps["perturbed"]
    assert g["abs_mean"] > 1e-2 and g["abs_mean"] > 1000 * max(gaps["own"]["abs_mean"], 1e-8), g


def test_a_stale_generator_is_named_by_the_version_offset(gaps):
    honest, claims, cur = gaps["stale_honest"], gaps["stale_claims_current"], gaps["current"]
    # honestly labelled: the whole gap sits at version offset 1 (staleness, not mismatch)
    assert honest["v1_frac"] == 1.0 and honest["v1_abs_mean"] > 1e-3 and "v0_abs_mean" not in honest, honest
    # a server that claims the current version while holding the old weights: offset 0, which is
    # ~0 for a healthy generator of the current weights, carries the whole gap
    assert claims["v0_frac"] == 1.0 and claims["v0_abs_mean"] > 1e-3, claims
    assert cur["v0_frac"] == 1.0 and cur["v0_abs_mean"] <= 1e-5, cur
