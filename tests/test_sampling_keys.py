"""The sampling keys ``top_p``, ``top_k``, ``min_p``, ``stop`` and ``stop_token_ids``, end to end.

Proves:

* the sampler's min-p (SGLang's meaning: keep tokens with probability >= min_p x the top
  probability, after temperature) against a float64 reference on known logits: cut tokens
  are never drawn, kept ones at their renormalised frequency, ``logprob_mode="sampling"``
  reports the renormalised probability, min-p intersects top-k / top-p, and min_p = 0 is
  the plain sampler bit for bit;
* the engine with min-p on a tiny model against transformers' logits;
* one-line errors naming the key (``SamplingParams``, ``ppo.*`` keys, OpenAI requests);
* ``ppo.top_p=... ppo.top_k=... ppo.min_p=... ppo.stop=[...] ppo.stop_token_ids=...`` parsed
  from the command line reach the ``ppo_actor`` MFCs (sync) and the ``math`` agent (async),
  and stop strings / ids end a synchronous generation (PPOActorInterface.generate on a
  MegatronEngine) and the math agent's completions where transformers' greedy text has them.
"""
from __future__ import annotations

import asyncio
import json
import math
import os

import pytest
import torch

from parallel.generation.sampler import SampleBatch, sample
from parallel.testing import make_tiny_hf, run_cases
from realflow.api.generation import SamplingParams

torch.set_num_threads(1)
MODULE = __name__.rsplit(".", 1)[-1]
LOGPROB_ATOL = 1e-4  # engine (fp32) vs transformers (fp32) log-probs
N_DRAWS = 20000
TEXTS = ["12 + 34 = 46", "the quick brown fox", "hello world", "<answer>46</answer>"] * 20


# --------------------------------------------------------------------------- sampler, known logits


def _logits(V: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(V, generator=g) * 2.0


def _batch(S: int, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
           seed: int = 1) -> SampleBatch:
    full = lambda v, dt: torch.full((S,), v, dtype=dt)  # noqa: E731
    u = torch.rand(S, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return SampleBatch(None, full(temperature, torch.float32), full(top_k, torch.long), full(top_p, torch.float32),
                       full(min_p, torch.float32), u, truncate=True)


def _reference(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
               min_p: float = 0.0) -> torch.Tensor:
    """The distribution sampled from, in float64: the intersection of the truncations (SGLang),
    with top-p taken on the top-k-renormalised distribution (transformers' order)."""
    p = torch.softmax(logits.double() / temperature, -1)
    keep = p >= min_p * p.max()
    srt, order = p.sort(descending=True)
    if top_k > 0:
        keep[order[top_k:]] = False
        srt = srt[:top_k]
    srt = srt / srt.sum()
    before = srt.cumsum(0) - srt
    if top_p < 1.0:
        keep[order[: len(srt)][before >= top_p]] = False
    q = p * keep
    return q / q.sum()


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.1), (0.6, 0, 1.0, 0.05), (1.7, 0, 1.0, 0.3), (1.0, 5, 1.0, 0.2), (1.3, 0, 0.8, 0.3),
    (1.0, 0, 0.95, 0.15), (1.0, 0, 1.0, 1.0)])
def test_min_p_draws_only_and_exactly_the_kept_distribution(temperature, top_k, top_p, min_p):
    logits = _logits()
    q = _reference(logits, temperature, top_k, top_p, min_p)
    # the case is one where min-p cuts tokens that the other settings keep
    assert int((q > 0).sum()) < int((_reference(logits, temperature, top_k, top_p) > 0).sum())
    tokens, raw, proc = sample(logits.expand(N_DRAWS, -1).contiguous(), _batch(N_DRAWS, temperature, top_k, top_p,
                                                                             min_p))
    assert bool((q[tokens] > 0).all()), f"drew a cut token: {sorted(set(tokens[q[tokens] == 0].tolist()))}"
    freq = torch.bincount(tokens, minlength=len(q)).double() / N_DRAWS
    bound = 5 * (q * (1 - q) / N_DRAWS).sqrt() + 1e-9  # 5 sigma of a binomial frequency
    assert bool(((freq - q).abs() <= bound).all()), (freq, q)
    assert torch.allclose(proc.double(), q[tokens].log(), atol=1e-5)  # logprob_mode="sampling"
    assert torch.allclose(raw.double(), torch.log_softmax(logits.double(), -1)[tokens], atol=1e-5)  # "raw"
    if min_p == 1.0:  # only the most likely token is left: greedy, probability 1
        assert bool((tokens == logits.argmax()).all()) and bool((proc == 0).all())


def test_min_p_zero_is_the_plain_sampler_bit_for_bit():
    """Rows with min_p = 0 draw as the untruncated inverse-CDF sampler does, with the same
    float bits, whatever their neighbours in the batch truncate."""
    g = torch.Generator().manual_seed(3)
    S, V = 64, 40
    logits = torch.randn(S, V, generator=g) * 3
    b = _batch(S, 0.9)
    b.min_p[1::2] = 0.25  # odd rows truncate, even rows must not notice
    b.top_k[1::4] = 6
    tokens, raw, proc = sample(logits, b)
    # the plain sampler: softmax(logits / T), inverse CDF in vocabulary order, no truncation at all
    probs = torch.softmax(logits / b.temperature[:, None], -1)
    cdf = probs.double().cumsum(-1)
    ref = torch.searchsorted(cdf, (b.uniform * cdf[:, -1])[:, None], right=True).squeeze(1).clamp(max=V - 1)
    ref_lp = (probs.gather(1, ref[:, None]).squeeze(1).double() / cdf[:, -1]).log().float()
    even = slice(0, S, 2)
    assert torch.equal(tokens[even], ref[even])
    assert torch.equal(proc[even], ref_lp[even])
    assert torch.equal(raw[even], torch.log_softmax(logits, -1).gather(1, ref[:, None]).squeeze(1)[even])
    plain = SampleBatch(None, b.temperature[even], torch.zeros(S // 2, dtype=torch.long), torch.ones(S // 2),
                        torch.zeros(S // 2), b.uniform[even], truncate=False)
    alone = sample(logits[even], plain)
    for got, want in zip((tokens[even], raw[even], proc[even]), alone):
        assert torch.equal(got, want)


# --------------------------------------------------------------------------- engine on a tiny model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, transformers model, tokenizer): a tiny random Qwen2 with a real BPE tokenizer."""
    from transformers import PreTrainedTokenizerFast

    from experiments.tasks.tokenizer import build_tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(TEXTS, vocab_size=120))
    path = str(tmp_path_factory.mktemp("tiny"))
    _, model = make_tiny_hf(path, seed=5, vocab_size=len(tok))
    return path, model, tok


@torch.no_grad()
def _hf_probs(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """Per output position, transformers' next-token probabilities at ``temperature`` [len(output), V]."""
    logits = model(torch.tensor([prompt + output])).logits[0].float()
    return torch.softmax(logits[len(prompt) - 1:-1].double() / temperature, -1)


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _cut(tok, base: list[int], stop: list[str], stop_ids: list[int]) -> list[int]:
    """``base`` up to (and with) the first token that ends on a stop id or completes a stop string."""
    for k in range(1, len(base) + 1):
        if base[k - 1] in stop_ids or any(s in tok.decode(base[:k]) for s in stop):
            return base[:k]
    return base


def test_engine_min_p_against_transformers(tiny):
    from parallel.generation import GenerationEngine

    path, model, _ = tiny
    eng = GenerationEngine.from_hf(path)
    prompt, T, mp = [3, 14, 15, 92, 65], 1.4, 0.2
    mk = lambda **kw: SamplingParams(max_new_tokens=24, ignore_eos=True, **kw)  # noqa: E731
    r = eng.generate([prompt], mk(temperature=T, min_p=mp, seed=9, logprob_mode="sampling"))[0]
    p = _hf_probs(model, prompt, r.output_ids, T)
    chosen = p.gather(1, torch.tensor(r.output_ids)[:, None]).squeeze(1)
    assert bool((chosen >= mp * p.max(-1).values - 1e-6).all()), "a token under min_p x max was drawn"
    kept = (p * (p >= mp * p.max(-1, keepdim=True).values)).sum(-1)
    want = (chosen / kept).log()
    assert (want - torch.tensor(r.output_logprobs, dtype=torch.float64)).abs().max() <= LOGPROB_ATOL
    raw = eng.generate([prompt], mk(temperature=T, min_p=mp, seed=9))[0]  # same draws, raw log-probs
    assert raw.output_ids == r.output_ids
    ref = _hf_probs(model, prompt, raw.output_ids, 1.0).gather(1, torch.tensor(raw.output_ids)[:, None]).log()
    assert (ref.squeeze(1) - torch.tensor(raw.output_logprobs, dtype=torch.float64)).abs().max() <= LOGPROB_ATOL
    # min_p = 1 keeps only the most likely token: greedy at any temperature
    assert eng.generate([prompt], mk(temperature=2.0, min_p=1.0, seed=1))[0].output_ids == _hf_greedy(model, prompt,
                                                                                                       24)
    # a min-p row shares the batch with other warpers and greedy rows; each equals its run alone
    params = [mk(temperature=T, min_p=mp, seed=2), mk(temperature=1.0, seed=3), mk(temperature=0.0),
              mk(temperature=0.8, top_k=4, min_p=0.1, seed=4, logprob_mode="sampling")]
    prompts = [prompt, [5], [7, 8, 9], [100, 101]]
    for p_, sp, together in zip(prompts, params, eng.generate(prompts, params)):
        alone = eng.generate([p_], sp)[0]
        assert together.output_ids == alone.output_ids
        assert together.output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)


# --------------------------------------------------------------------------- validation: one line naming the key


@pytest.mark.parametrize("value", [1.5, -0.1, "0.1", True, float("nan"), None])
def test_sampling_params_min_p_errors(value):
    with pytest.raises(ValueError) as e:
        SamplingParams(min_p=value).validate()
    msg = str(e.value)
    assert msg == f"sampling_params.min_p={value!r}: must be in [0, 1] (0 = off)" and "\n" not in msg
    with pytest.raises(ValueError, match=r"^sampling_params\.min_p="):
        SamplingParams.from_dict({"min_p": value})
    sp = SamplingParams.from_dict({"min_p": 0, "top_k": 50, "top_p": 0.9})
    assert (sp.min_p, sp.top_k, sp.top_p) == (0.0, 50, 0.9) and isinstance(sp.min_p, float)


def _config(exp: str, *over: str):
    from realflow.config.cli import import_modules, parse_overrides
    from realflow.api.experiment import experiment_registry

    import_modules(["experiments"])
    return parse_overrides(experiment_registry.get(exp), ["fileroot=/nonexistent", *over])


@pytest.mark.parametrize("arg,message", [
    ("ppo.top_p=0", "ppo.top_p=0.0 must be in (0, 1] (1 = off)"),
    ("ppo.top_p=1.2", "ppo.top_p=1.2 must be in (0, 1] (1 = off)"),
    ("ppo.top_k=0", "ppo.top_k=0 must be -1 (off) or an integer >= 1"),
    ("ppo.min_p=1.5", "ppo.min_p=1.5 must be in [0, 1] (0 = off)"),
    ("ppo.min_p=-0.1", "ppo.min_p=-0.1 must be in [0, 1] (0 = off)"),
    ('ppo.stop=["</answer>", ""]', "ppo.stop=['</answer>', ''] must be a list of non-empty strings"),
    ("ppo.stop_token_ids=7,-9", "ppo.stop_token_ids=[7, -9] must be a list of token ids (integers >= 0)"),
])
def test_ppo_sampling_key_errors(arg, message):
    from realflow.config.cli import ConfigError

    for exp in ("grpo-math", "async-grpo-math"):
        with pytest.raises(ConfigError) as e:
            _config(exp, arg)
        assert str(e.value) == f"invalid config: {message}", str(e.value)


def test_openai_request_sampling_keys():
    from realflow.rollout.openai_requests import APIError, parse_chat, parse_completion

    base = {"model": "policy", "prompt": "1+1="}
    req = parse_completion(dict(base, top_k=50, min_p=0.05, top_p=0.9, stop="</a>"), "policy", 4)
    assert (req.top_k, req.min_p, req.top_p, req.stop) == (50, 0.05, 0.9, ["</a>"])
    assert (parse_completion(base, "policy", 4).top_k, parse_completion(base, "policy", 4).min_p) == (-1, 0.0)
    assert parse_completion(dict(base, top_k=0), "policy", 4).top_k == -1  # vLLM: 0 and -1 are off
    chat = parse_chat({"model": "policy", "messages": [{"role": "user", "content": "x"}], "min_p": 1}, "policy", 4)
    assert chat.min_p == 1.0
    for param, value in (("top_k", -2), ("top_k", 2.5), ("top_k", True), ("top_k", "5"), ("min_p", 1.5),
                         ("min_p", -0.5), ("min_p", "0.1"), ("top_p", 0), ("top_p", 1.5)):
        with pytest.raises(APIError) as e:
            parse_completion(dict(base, **{param: value}), "policy", 4)
        err = e.value
        assert err.status == 400 and err.param == param and "\n" not in err.message, (param, value)
        assert err.message.startswith(f"Invalid value for '{param}': expected") and repr(value) in err.message


# --------------------------------------------------------------------------- the command line reaches the sampler


SAMPLING = ["ppo.top_p=0.9", "ppo.top_k=50", "ppo.min_p=0.05", 'ppo.stop=["</answer>"]', "ppo.stop_token_ids=7,9"]
WANT = {"top_p": 0.9, "top_k": 50, "min_p": 0.05, "stop": ["</answer>"], "stop_token_ids": [7, 9]}


def test_ppo_keys_reach_the_actor_and_the_math_agent(tmp_path):
    from realflow.api.agent import make_agent
    from realflow.api.interface import make_interface

    sync = _config("grpo-math", f"fileroot={tmp_path}", *SAMPLING)
    assert sync.ppo.sampling_args() == {"temperature": 1.0, **WANT}
    gen = [m for m in sync.setup().mfcs if m.interface_impl == "ppo_actor"]
    assert {m.name for m in gen} >= {"actor_gen", "actor_train"}
    for m in gen:
        actor = make_interface("ppo_actor", **m.interface_args)
        assert {k: getattr(actor, k) for k in WANT} == WANT, m.name
    plain = make_interface("ppo_actor", **_config("grpo-math").ppo.actor_args())
    assert (plain.top_p, plain.top_k, plain.min_p, plain.stop, plain.stop_token_ids) == (1.0, -1, 0.0, [], [])

    asyn = _config("async-grpo-math", f"fileroot={tmp_path}", *SAMPLING, "ppo.temperature=0.7")
    rollout = asyn.setup().rollout
    assert rollout.agent == "math"
    assert {k: rollout.agent_args[k] for k in ("temperature", *WANT)} == {"temperature": 0.7, **WANT}
    agent = make_agent("math", rollout.agent_args)
    assert {k: getattr(agent, k) for k in WANT} == WANT and agent.temperature == 0.7
    # the agent's own args still win over the ppo keys (rollout.agent_args is applied last)
    mine = _config("async-grpo-math", f"fileroot={tmp_path}", *SAMPLING, 'rollout.agent_args={"min_p": 0.2}')
    assert mine.setup().rollout.agent_args["min_p"] == 0.2
    with pytest.raises(ValueError, match=r"^sampling_params\.min_p=2"):
        make_agent("math", {"min_p": 2})


class _EngineContext:
    """An :class:`realflow.api.agent.AgentContext` over a real in-process engine: the agent's
    ``sampling_params`` go through ``SamplingParams.from_dict`` as a gen server's /generate does,
    and rewards through the rollout worker's own scoring function."""

    def __init__(self, engine, tokenizer) -> None:
        self.engine, self.tokenizer, self.seed = engine, tokenizer, 11
        self.sent: list[dict] = []
        self.results: list = []

    async def generate(self, input_ids, sampling_params, n=1):
        from realflow.api.agent import Completion

        self.sent.append(dict(sampling_params))
        res = self.engine.generate([list(input_ids)], SamplingParams.from_dict(dict(sampling_params, n=n)))
        self.results += res
        return [Completion(r.prompt_ids, r.output_ids, r.output_logprobs, r.output_versions,
                           r.finish_reason["type"]) for r in res]

    async def score(self, reward, samples, args=None):
        from realflow.rollout.rollout_worker import _score_in_child

        return _score_in_child(reward, list(samples), dict(args or {}))


def test_math_agent_sends_min_p_and_stops(tiny, tmp_path):
    """min_p = 1 at temperature 1.5 must be greedy, and the stop string / id must cut it: the
    agent's completions equal transformers' greedy text cut there."""
    from parallel.generation import GenerationEngine
    from realflow.api.agent import make_agent

    path, model, tok = tiny
    prompt = tok.encode("hello")
    base = _hf_greedy(model, prompt, 16)
    target = tok.decode(base[:9])[-2:]
    assert target.strip(), "degenerate tokenizer output"
    stop_id = base[12]
    cfg = _config("async-grpo-math", f"fileroot={tmp_path}", "ppo.temperature=1.5", "ppo.min_p=1.0",
                  "ppo.max_new_tokens=16", "ppo.n_samples=2", f"ppo.stop={json.dumps([target])}",
                  f"ppo.stop_token_ids={stop_id}")
    agent = make_agent("math", cfg.setup().rollout.agent_args)
    ctx = _EngineContext(GenerationEngine.from_hf(path, tokenizer=tok), tok)
    trajs = asyncio.run(agent.run({"id": "r0", "prompt_ids": prompt, "answer": "46"}, ctx))
    assert len(trajs) == 2 and ctx.sent[0]["min_p"] == 1.0 and ctx.sent[0]["stop"] == [target]
    want = _cut(tok, base, [target], [stop_id])
    assert len(want) < len(base), "the stop must cut the greedy text"
    for r in ctx.results:
        assert r.output_ids == want and r.finish_reason["type"] == "stop"


# --------------------------------------------------------------------------- sync generation (PPOActorInterface)


def case_sync_generate_stops(ctx):
    """PPOActorInterface.generate on a MegatronEngine, with the ppo keys parsed from the command
    line: greedy outputs (transformers) cut at the first stop string or stop id."""
    from transformers import PreTrainedTokenizerFast

    from experiments.tasks.tokenizer import build_tokenizer
    from mfc.rl_batch import INPUT_IDS, NO_EOS, PROMPT_MASK
    from parallel.engine import MegatronEngine
    from parallel.groups import ParallelStrategy, build_model_groups
    from realflow.api.batch import SequenceBatch
    from realflow.api.interface import Model, make_interface

    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(TEXTS, vocab_size=120))
    path = os.path.join(ctx.tmpdir, "m")
    cfg, hf = make_tiny_hf(path, seed=5, vocab_size=len(tok))
    prompts = [tok.encode("hello"), tok.encode("12 +"), [7, 8, 9]]
    bases = [_hf_greedy(hf, p, 16) for p in prompts]
    # a stop id that ends prompt 1's text only, and a stop string that ends prompt 0's only
    j, stop_id = next((j, t) for j, t in enumerate(bases[1]) if j >= 2 and t not in bases[0])
    early = tok.decode(bases[1][:j + 1])
    target = next(x for x in (tok.decode(bases[0][:k])[-2:] for k in range(3, 16)) if x.strip() and x not in early)
    keys = ["ppo.temperature=0", "ppo.max_new_tokens=16", "ppo.top_p=0.9", "ppo.top_k=50", "ppo.min_p=0.05",
            f"ppo.stop={json.dumps([target])}", f"ppo.stop_token_ids={stop_id}"]
    actor = make_interface("ppo_actor", **{**_config("grpo-math", *keys).ppo.actor_args(), "seed": 1})
    eng = MegatronEngine(cfg, build_model_groups([0], ParallelStrategy(1, 1, 1)), path, seed=1)
    batch = SequenceBatch.from_samples([f"s{i}" for i in range(len(prompts))],
                                       {"packed_prompts": [torch.tensor(p) for p in prompts]})
    out = actor.generate(Model("actor", eng, tok), batch, None)
    got, no_eos = [], []
    for i, p in enumerate(prompts):
        seq = out.sequences(INPUT_IDS, i)[0].tolist()
        assert out.sequences(PROMPT_MASK, i)[0].sum().item() == len(p)
        got.append(seq[len(p):])
        no_eos.append(float(out.sequences(NO_EOS, i)[0].item()))
    return {"got": got, "no_eos": no_eos, "want": [_cut(tok, b, [target], [stop_id]) for b in bases],
            "bases": bases, "target": target, "stop_id": stop_id, "texts": [tok.decode(w) for w in got]}


def test_stop_strings_and_ids_end_a_sync_generation():
    res = run_cases([f"{MODULE}:case_sync_generate_stops"], world_size=1, timeout=240,
                    pythonpath=[os.path.dirname(os.path.abspath(__file__))])["case_sync_generate_stops"]
    assert res.ok, res.error
    d = res.data[0]
    assert d["got"] == d["want"], d
    # both kinds of stop acted: the string on prompt 0, the id on prompt 1
    assert len(d["want"][0]) < 16 and d["target"] in d["texts"][0] and d["stop_id"] not in d["want"][0]
    assert len(d["want"][1]) < 16 and d["want"][1][-1] == d["stop_id"]
    assert d["no_eos"] == [0.0 if len(w) < len(b) else 1.0 for w, b in zip(d["want"], d["bases"])]


def test_reference_renormalisation_sanity():
    """The float64 reference itself: a distribution, and min_p = 0 / top_p = 1 / top_k = 0 are no-ops."""
    logits = _logits()
    q = _reference(logits, 0.8)
    assert math.isclose(float(q.sum()), 1.0) and torch.allclose(q, torch.softmax(logits.double() / 0.8, -1))
