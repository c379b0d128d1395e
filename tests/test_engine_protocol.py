"""The algorithm <-> engine seam (realflow/api/engine.py): every engine in the tree satisfies
``TrainEngine`` (statically: every member on the class; and on a really built engine), the
engine owns its generator (no attribute stored on it by anyone else), backends' abilities are
typed capability protocols, and a user package's own engine class passes the same check,
is accepted by the model store and runs realflow's own interfaces, while a class missing
members fails at build time with an error naming them."""
from __future__ import annotations

import ast
import importlib
import os
from types import SimpleNamespace
from typing import Any, Optional, Sequence

import pytest
import torch

import mfc.ppo_actor  # noqa: F401  (registers "ppo_actor")
import mfc.sft  # noqa: F401  (registers "sft")
from parallel.testing import make_tiny_hf, run_cases
from realflow.api.allocation import ParallelStrategy
from realflow.api.backend import LocalStateful, NoModelBackend, Offloadable, Reallocatable, register_backend
from realflow.api.batch import MicroBatchSpec, SequenceBatch
from realflow.api.engine import (
    BatchGenerator, NonFiniteConfigurable, TrainEngine, check_engine, protocol_members,
)
from realflow.api.experiment import DatasetSpec, ExperimentSetup, ModelSpec, OptimizerConfig
from realflow.api.generation import GenerationResult, SamplingParams
from realflow.api.interface import Model, make_interface
from realflow.api.mfc import MFCDef
from realflow.system.model_store import HookError, ModelStore
from realflow.system.plan import compile_plan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE = "test_engine_protocol"
MEMBERS = protocol_members(TrainEngine)


# ---- the contract itself -----------------------------------------------------------------------


def test_the_contract_names_what_algorithms_use():
    assert set(MEMBERS) == {"strategy", "is_critic", "train_batch", "logprobs", "values", "dp_sum", "dp_max",
                            "greedy_generate", "generator", "save_hf", "full_hf_state"}
    for name in MEMBERS:  # one line each saying what it promises
        doc = getattr(TrainEngine, name).__doc__
        assert doc and doc.strip(), name


def _engine_classes_in_tree() -> list[tuple[str, str]]:
    """(module, class) of every class under parallel/ and examples/ that defines ``train_batch``."""
    found = []
    for top in ("parallel", "examples"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(root, f)
                tree = ast.parse(open(path).read(), path)
                for node in ast.walk(tree):
                    if isinstance(node, ast.ClassDef) and any(
                            isinstance(b, ast.FunctionDef) and b.name == "train_batch" for b in node.body):
                        mod = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                        found.append((mod.removesuffix(".__init__"), node.name))
    return found


def test_every_engine_class_in_the_tree_has_every_member():
    classes = _engine_classes_in_tree()
    assert ("parallel.engine", "MegatronEngine") in classes
    for mod, name in classes:
        cls = getattr(importlib.import_module(mod), name)
        assert check_engine(cls, f"{mod}.{name}") is cls  # the check works on classes too
        missing = [m for m in MEMBERS if not hasattr(cls, m)]
        assert not missing, (mod, name, missing)
        assert isinstance(getattr(cls, "strategy"), property) and isinstance(getattr(cls, "is_critic"), property)


def test_builtin_backends_have_typed_capabilities():
    from parallel.backend import MegatronBackend

    b = MegatronBackend()
    assert isinstance(b, Reallocatable) and isinstance(b, Offloadable) and isinstance(b, LocalStateful)
    none = NoModelBackend()
    assert not isinstance(none, (Reallocatable, Offloadable, LocalStateful))
    assert none.build_engine(ModelSpec("r", "unused"), None, 1) is None


def test_mfc_does_not_reach_into_parallel_or_store_on_engines():
    """Interfaces talk to engines through the protocol only: no parallel imports, no attributes set."""
    for top in ("mfc", "examples"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for f in (x for x in files if x.endswith(".py")):
                path = os.path.join(root, f)
                tree = ast.parse(open(path).read(), path)
                for node in ast.walk(tree):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                        assert not any(n == "parallel" or n.startswith("parallel.") for n in names), (path, names)
                    if isinstance(node, ast.Assign):
                        for t in node.targets:
                            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                                assert t.value.id not in ("eng", "engine"), (path, node.lineno)
                    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                            node.func.id in ("getattr", "hasattr", "setattr") and node.args and \
                            isinstance(node.args[0], ast.Name) and node.args[0].id in ("eng", "engine"):
                        raise AssertionError(f"{path}:{node.lineno}: {node.func.id} on an engine")


# ---- a really built MegatronEngine (one process) -----------------------------------------------


def case_megatron_engine(ctx):
    from parallel.backend import MegatronBackend

    lm, critic = os.path.join(ctx.tmpdir, "lm"), os.path.join(ctx.tmpdir, "critic")
    make_tiny_hf(lm, seed=3)
    make_tiny_hf(critic, seed=4, critic=True)
    backend = MegatronBackend()
    groups = backend.build_groups([0], ParallelStrategy(1, 1, 1))
    eng = backend.build_engine(ModelSpec("actor", lm, optimizer=OptimizerConfig(), total_train_steps=2), groups, 1)
    out: dict[str, Any] = {}
    out["train_engine"] = isinstance(eng, TrainEngine) and check_engine(eng, "megatron") is eng
    out["nonfinite"] = isinstance(eng, NonFiniteConfigurable)
    out["is_critic"], out["strategy"] = eng.is_critic, str(eng.strategy)
    before = set(vars(eng))
    gen = eng.generator(8, version=0)
    out["batch_generator"] = isinstance(gen, BatchGenerator)
    out["same"] = eng.generator(8, version=0) is gen
    res = gen.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, temperature=0.0))
    greedy = eng.greedy_generate([[1, 2, 3]], 3)
    out["greedy_agrees"] = res[0].output_ids == greedy[0]
    bigger = eng.generator(40, version=0)
    out["rebuilt_larger"] = bigger is not gen and bigger.max_context >= 40
    out["version_told"] = eng.generator(8, version=5).weight_version == 5
    # ppo.enforce_eager / kv_block_size / prefix_sharing reach the generator's engine (a new one)
    tuned = eng.generator(8, version=5, kv_block_size=32, prefix_sharing=False, enforce_eager=True)
    out["settings"] = [tuned is not bigger, tuned.config.block_size, tuned.config.prefix_sharing,
                       tuned.config.enforce_eager, eng.generator(8, version=5, kv_block_size=32, prefix_sharing=False,
                                                                 enforce_eager=True) is tuned]
    backend.offload(eng)
    backend.reload(eng)
    out["no_new_attributes"] = sorted(set(vars(eng)) - before)
    out["local_state_keys"] = sorted(backend.local_state(eng))[:3]
    ceng = backend.build_engine(ModelSpec("critic", critic, backend_args={"critic": True}), groups, 1)
    out["critic_ok"] = isinstance(ceng, TrainEngine) and ceng.is_critic
    try:
        ceng.generator(8, version=0)
        out["critic_generator"] = "no error"
    except TypeError as e:
        out["critic_generator"] = str(e)
    return out


def test_a_built_megatron_engine_satisfies_the_protocol_and_owns_its_generator():
    res = run_cases([f"{MODULE}:case_megatron_engine"], world_size=1, timeout=240,
                    pythonpath=[os.path.dirname(os.path.abspath(__file__))])["case_megatron_engine"]
    assert res.ok, res.error
    d = res.data[0]
    assert d["train_engine"] and d["nonfinite"] and d["batch_generator"], d
    assert d["is_critic"] is False and d["strategy"] == "d1t1p1"
    assert d["same"] and d["greedy_agrees"] and d["rebuilt_larger"] and d["version_told"], d
    assert d["settings"] == [True, 32, False, True, True], d
    # the generator lives in the engine's own slot; offload/reload leave nothing on the engine
    assert d["no_new_attributes"] == [], d
    assert d["critic_ok"] and "critic" in d["critic_generator"], d


# ---- a user package's own engine ---------------------------------------------------------------


class _BigramOutputs:
    """TokenOutputs of a bigram LM: the logits are a row of the table per input token."""

    def __init__(self, logits: torch.Tensor) -> None:
        self._logits = logits

    @property
    def n_tokens(self) -> int:
        return int(self._logits.shape[0])

    def _logp(self, temperature: float) -> torch.Tensor:
        return torch.log_softmax(self._logits / temperature, -1)

    def logprobs(self, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        return self._logp(temperature).gather(-1, targets.long()[:, None])[:, 0]

    def entropy(self, temperature: float = 1.0) -> torch.Tensor:
        lp = self._logp(temperature)
        return -(lp.exp() * lp).sum(-1)

    def logprobs_and_entropy(self, targets: torch.Tensor, temperature: float = 1.0):
        return self.logprobs(targets, temperature), self.entropy(temperature)

    def argmax(self) -> torch.Tensor:
        return self._logits.detach().argmax(-1)

    def logits(self) -> torch.Tensor:
        return self._logits

    def values(self) -> torch.Tensor:
        raise TypeError("a bigram LM has no value head")


class _BigramGenerator:
    def __init__(self, engine: "BigramEngine") -> None:
        self.engine, self.version = engine, 0

    def generate(self, prompts: Sequence[Sequence[int]], params: Any) -> list[GenerationResult]:
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        out = []
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            for k in range(sp.n):
                g = torch.Generator().manual_seed((sp.seed or 0) + k)
                ids, lps, reason = [], [], {"type": "length", "length": sp.max_new_tokens}
                last = int(p[-1])
                for _ in range(sp.max_new_tokens):
                    logp = torch.log_softmax(self.engine.table.detach()[last], -1)
                    tok = int(logp.argmax()) if sp.temperature == 0 else \
                        int(torch.multinomial((logp / sp.temperature).softmax(-1), 1, generator=g))
                    ids.append(tok)
                    lps.append(float(logp[tok]))
                    last = tok
                    if tok in sp.stop_token_ids:
                        reason = {"type": "stop", "matched": tok}
                        break
                out.append(GenerationResult(f"r{i}-{k}", list(map(int, p)), ids, lps, [self.version] * len(ids),
                                            reason, f"r{i}", k))
        return out


class BigramEngine:
    """What a user package might bring: a one-process bigram LM trained with SGD."""

    def __init__(self, vocab: int = 16, lr: float = 0.5) -> None:
        self.table = torch.nn.Parameter(torch.zeros(vocab, vocab))
        self.opt = torch.optim.SGD([self.table], lr=lr)
        self._gen: Optional[_BigramGenerator] = None

    @property
    def strategy(self) -> ParallelStrategy:
        return ParallelStrategy()

    @property
    def is_critic(self) -> bool:
        return False

    def train_batch(self, micro_batches, loss_fn, loss_weight_fn, sample_ids=None) -> dict[str, float]:
        self.opt.zero_grad()
        total_w = sum(float(loss_weight_fn(extra)) for _, _, extra in micro_batches)
        losses, stats = [], {}
        for ids, _, extra in micro_batches:
            loss_sum, st = loss_fn(_BigramOutputs(self.table[ids.long()]), extra)
            (loss_sum / total_w).backward()
            losses.append(float(loss_sum.detach()))
            for k, v in st.items():
                stats[k] = stats.get(k, 0.0) + float(v)
        self.opt.step()
        return {"loss": sum(losses) / total_w, "grad_norm": 0.0, "lr": 0.5, "loss_weight": total_w,
                "n_mbs": float(len(micro_batches)), "update_successful": 1.0, **stats}

    def logprobs(self, input_ids, seqlens, max_tokens_per_mb=None, *, temperature=1.0, with_entropy=False):
        with torch.no_grad():
            out = _BigramOutputs(self.table[input_ids.long()])
            targets = torch.roll(input_ids, -1)
            lp, ent = out.logprobs(targets, temperature), out.entropy(temperature)
            ends = torch.tensor(seqlens).cumsum(0) - 1
            lp[ends] = 0.0
        return (lp, ent) if with_entropy else lp

    def values(self, input_ids, seqlens, max_tokens_per_mb=None):
        raise TypeError("a bigram LM has no value head")

    def dp_sum(self, values: list[float]) -> list[float]:
        return [float(v) for v in values]

    def dp_max(self, values: list[float]) -> list[float]:
        return [float(v) for v in values]

    def greedy_generate(self, prompts, max_new_tokens, eos_token_id=None, max_tokens_per_mb=None):
        sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                            stop_token_ids=[] if eos_token_id is None else [eos_token_id])
        return [r.output_ids for r in _BigramGenerator(self).generate(prompts, sp)]

    def generator(self, context: int, *, version: int, tokenizer: Any = None, max_running: int = 256):
        if self._gen is None:
            self._gen = _BigramGenerator(self)
        self._gen.version = version
        return self._gen

    def save_hf(self, path: str, tokenizer_dir: Optional[str] = None) -> None:
        os.makedirs(path, exist_ok=True)
        torch.save(self.full_hf_state(), os.path.join(path, "bigram.pt"))

    def full_hf_state(self) -> dict[str, torch.Tensor]:
        return {"table": self.table.detach().clone()}


class HalfEngine:
    """A user engine that forgot most of the contract (and made one member a number)."""

    strategy = ParallelStrategy()
    is_critic = False
    dp_sum = 3

    def train_batch(self, micro_batches, loss_fn, loss_weight_fn, sample_ids=None):
        return {}


@register_backend("test_user_bigram")
class BigramBackend:
    def build_groups(self, ranks, strategy):
        return None

    def build_engine(self, spec, groups, seed, *, load_weights=True) -> TrainEngine:
        return BigramEngine()


@register_backend("test_user_half")
class HalfBackend:
    def build_groups(self, ranks, strategy):
        return None

    def build_engine(self, spec, groups, seed, *, load_weights=True):
        return HalfEngine()


def test_a_user_engine_passes_the_same_check():
    eng = BigramEngine()
    assert isinstance(eng, TrainEngine) and check_engine(eng, "user") is eng
    assert check_engine(BigramEngine, "user class") is BigramEngine
    assert not isinstance(eng, NonFiniteConfigurable)  # a capability it does not have
    assert isinstance(eng.generator(8, version=0), BatchGenerator)


def test_a_class_missing_members_fails_naming_them():
    assert not isinstance(HalfEngine(), TrainEngine)
    with pytest.raises(TypeError) as e:
        check_engine(HalfEngine(), "model backend 'mine' of role 'actor'")
    msg = str(e.value)
    assert msg.startswith("model backend 'mine' of role 'actor': ") and "HalfEngine is not a TrainEngine" in msg
    for name in ("dp_max", "full_hf_state", "generator", "greedy_generate", "logprobs", "save_hf", "values"):
        assert name in msg.split("missing ")[1].split(";")[0], (name, msg)
    assert "not callable: dp_sum" in msg and "realflow.api.engine.TrainEngine" in msg
    for present in ("train_batch", "strategy", "is_critic"):
        assert present not in msg.split("missing ")[1].split(";")[0]


def _store(tmp_path, backend: str) -> ModelStore:
    models = {"actor": ModelSpec("actor", str(tmp_path / "ckpt"), optimizer=OptimizerConfig(), backend=backend)}
    mfcs = [MFCDef("actor_train", "actor", "train_step", "sft", input_keys=("packed_prompts",))]
    setup = ExperimentSetup("engine_protocol", "t0", mfcs, models, DatasetSpec("prompt_answer", "unused.jsonl"),
                            1, "d1", str(tmp_path / "run"))
    return ModelStore(setup, compile_plan(setup), 0)


def test_the_model_store_accepts_a_user_engine_and_rejects_a_half_one(tmp_path):
    store = _store(tmp_path, "test_user_bigram")
    store.build(total_train_steps=1, load_tokenizer=lambda path: None)
    (model,) = store.models.values()
    assert isinstance(model.module, BigramEngine)
    # the backend has no recover-point capability: said in words, not an AttributeError
    with pytest.raises(HookError, match="cannot write recover points"):
        store.local_state()
    with pytest.raises(TypeError, match=r"model backend 'test_user_half' of role 'actor' \(build_engine\): "
                                        r".*HalfEngine is not a TrainEngine \(missing dp_max"):
        _store(tmp_path, "test_user_half").build(total_train_steps=1, load_tokenizer=lambda path: None)


def test_realflow_interfaces_run_on_a_user_engine():
    """SFT trains it (train_batch + TokenOutputs), the PPO actor samples with its generator."""
    eng = BigramEngine(vocab=8)
    model = Model("actor", eng, tokenizer=SimpleNamespace(eos_token_id=None))
    seqs = [torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([1, 2, 3, 4])]
    batch = SequenceBatch.from_samples(["a", "b"], {
        "packed_input_ids": [[s] for s in seqs],
        "prompt_mask": [[torch.tensor([1, 0, 0, 0, 0, 0], dtype=torch.bool)],
                        [torch.tensor([1, 0, 0, 0], dtype=torch.bool)]]})
    sft = make_interface("sft")
    losses = [sft.train_step(model, batch, MicroBatchSpec(n_mbs=2))["loss"] for _ in range(5)]
    assert losses[-1] < losses[0], losses
    actor = make_interface("ppo_actor", max_new_tokens=3, n_samples=2)
    prompts = SequenceBatch.from_samples(["p"], {"packed_prompts": [torch.tensor([1, 2])]})
    out = actor.generate(model, prompts, MicroBatchSpec())
    ids = out.sequences("packed_input_ids", 0)
    assert len(ids) == 2 and all(s[:2].tolist() == [1, 2] and len(s) == 5 for s in ids)
    # after training, the bigram continues the pattern it was taught
    assert eng.greedy_generate([[2]], 3) == [[3, 4, 5]]
