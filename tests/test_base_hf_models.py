"""realflow.base.hf_models: a user's model named by directory or hub id, resolved offline.

Everything runs on real files from tests/user_model_fixture.py: a Qwen-format ChatML
tokenizer, a tiny Qwen2 checkpoint, and the hub cache layout huggingface_hub itself reads.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from realflow.base.hf_models import (SUPPORTED_ARCHITECTURES, SUPPORTED_MODEL_TYPES, ModelPathError,
                                     UnsupportedArchitectureError, check_architecture, describe_supported,
                                     hub_cache_dir, is_hub_id, model_context_length, resolve_model_path)
from user_model_fixture import (IM_END, chatml_template, make_chat_tokenizer, make_hub_cache,
                                make_qwen2_checkpoint, make_unsupported_checkpoint, shared_chat_model)

REPO = "acme/tiny-chat"
_HUB_ENV = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(tokenizer_dir, checkpoint_dir) of the session's tiny chat model."""
    return shared_chat_model(tmp_path_factory)


@pytest.fixture(scope="module")
def hub(tmp_path_factory, model):
    """A hub cache at ``<home>/hub`` holding REPO at branch main (the shared checkpoint) and at
    branch dev (another seed): dict with home, cache, main, dev (snapshot dirs)."""
    tok_dir, ckpt = model
    home = tmp_path_factory.mktemp("hf_home")
    cache = str(home / "hub")
    dev_ckpt = make_qwen2_checkpoint(str(tmp_path_factory.mktemp("dev") / "ckpt"), tok_dir, seed=1)
    return dict(home=str(home), cache=cache, main=make_hub_cache(cache, REPO, ckpt),
                dev=make_hub_cache(cache, REPO, dev_ckpt, revision_name="dev"))


@pytest.fixture
def hub_env(monkeypatch):
    """A clean hub environment: none of the cache variables set (HOME still real)."""
    for name in _HUB_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# --------------------------------------------------------------------------- local directories


def test_local_directory_is_returned_absolute(model):
    _, ckpt = model
    assert resolve_model_path(ckpt) == os.path.abspath(ckpt)
    assert resolve_model_path(ckpt + "/") == os.path.abspath(ckpt)


def test_relative_and_home_directories(model, tmp_path, monkeypatch):
    _, ckpt = model
    parent, name = os.path.split(ckpt)
    monkeypatch.chdir(parent)
    assert resolve_model_path(name) == ckpt
    assert resolve_model_path(f"./{name}") == ckpt
    monkeypatch.setenv("HOME", parent)
    assert resolve_model_path(f"~/{name}") == ckpt


def test_an_existing_directory_shaped_like_a_hub_id_wins(hub, hub_env, tmp_path):
    hub_env.setenv("HF_HUB_CACHE", hub["cache"])
    (tmp_path / "acme" / "tiny-chat").mkdir(parents=True)
    hub_env.chdir(tmp_path)
    assert resolve_model_path(REPO) == str(tmp_path / "acme" / "tiny-chat")


def test_missing_local_directory_is_one_line_naming_it(tmp_path, hub_env):
    hub_env.chdir(tmp_path)
    with pytest.raises(ModelPathError) as e:
        resolve_model_path("/x/y")
    assert str(e.value) == "model.path: no directory /x/y (and not a hub id of the form org/name)"
    for ref in ("./gone", "a/b/c", "~/gone", "gone"):
        with pytest.raises(ModelPathError, match=r"^models\.actor\.path: no directory /\S+ \(and not a hub id"):
            resolve_model_path(ref, what="models.actor.path")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelPathError, match=r"weights\.bin is a file; give the checkpoint's directory$"):
        resolve_model_path("weights.bin")
    with pytest.raises(ModelPathError, match="model.path: empty"):
        resolve_model_path("")


@pytest.mark.parametrize("ref,expected", [
    ("Qwen/Qwen2.5-0.5B-Instruct", True), ("meta-llama/Llama-3.2-1B", True), ("org_1/name.v2", True),
    ("gpt2", False), ("a/b/c", False), ("/abs/path", False), ("./org/name", False), ("~/org", False),
    ("org/-bad", False), ("org/na--me", False), ("org/name.git", False), ("org/na me", False), ("", False),
])
def test_hub_id_shape(ref, expected):
    assert is_hub_id(ref) is expected


# --------------------------------------------------------------------------- hub cache


def test_hub_cache_layout_is_what_huggingface_hub_reads(hub):
    from huggingface_hub import scan_cache_dir, snapshot_download, try_to_load_from_cache

    info = scan_cache_dir(hub["cache"])
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert (repo.repo_id, repo.repo_type) == (REPO, "model")
    revisions = {r.commit_hash: r for r in repo.revisions}
    assert {os.path.basename(hub["main"]), os.path.basename(hub["dev"])} == set(revisions)
    assert set(repo.refs) == {"main", "dev"}
    assert {f.file_name for f in revisions[os.path.basename(hub["main"])].files} >= {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    assert snapshot_download(REPO, cache_dir=hub["cache"], local_files_only=True) == hub["main"]
    assert try_to_load_from_cache(REPO, "config.json", cache_dir=hub["cache"], revision="dev") == \
        os.path.join(hub["dev"], "config.json")


def test_hub_id_resolves_through_HF_HUB_CACHE(hub, hub_env):
    hub_env.setenv("HF_HUB_CACHE", hub["cache"])
    hub_env.setenv("HF_HOME", "/nonexistent/elsewhere")  # HF_HUB_CACHE wins, as in huggingface_hub
    assert resolve_model_path(REPO) == hub["main"]


def test_hub_id_resolves_through_HF_HOME(hub, hub_env):
    hub_env.setenv("HF_HOME", hub["home"])
    assert hub_cache_dir() == hub["cache"]
    assert resolve_model_path(REPO) == hub["main"]


def test_revision_by_branch_and_by_commit(hub, hub_env):
    hub_env.setenv("HF_HUB_CACHE", hub["cache"])
    assert resolve_model_path(REPO, revision="dev") == hub["dev"]
    assert resolve_model_path(REPO, revision=os.path.basename(hub["dev"])) == hub["dev"]
    assert resolve_model_path(REPO, revision=os.path.basename(hub["main"])) == hub["main"]
    weights = [os.path.realpath(os.path.join(hub[b], "model.safetensors")) for b in ("main", "dev")]
    assert weights[0] != weights[1]  # two seeds: two blobs


def test_hub_id_missing_from_cache_says_where_it_looked_and_how_to_fetch(hub, hub_env, tmp_path):
    hub_env.chdir(tmp_path)
    hub_env.setenv("HF_HUB_CACHE", hub["cache"])
    with pytest.raises(ModelPathError) as e:
        resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct", what="models.actor.path")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"models.actor.path: no directory {tmp_path}/Qwen/Qwen2.5-0.5B-Instruct, and hub model "
                          f"Qwen/Qwen2.5-0.5B-Instruct (revision main) is not in the Hugging Face cache {hub['cache']}")
    assert "`hf download Qwen/Qwen2.5-0.5B-Instruct`" in msg and "huggingface-cli download" in msg
    assert "HF_HUB_CACHE" in msg and "HF_HOME" in msg
    with pytest.raises(ModelPathError, match=r"hub model acme/tiny-chat \(revision v9\) is not in .*"
                                             r"`hf download acme/tiny-chat --revision v9`"):
        resolve_model_path(REPO, revision="v9")
    with pytest.raises(ModelPathError, match=r"\(revision 0{40}\) is not in"):
        resolve_model_path(REPO, revision="0" * 40)


def test_snapshot_without_config_json(tmp_path, model, hub_env):
    tok_dir, _ = model
    cache = str(tmp_path / "cache")
    hub_env.setenv("HF_HUB_CACHE", cache)
    snapshot = make_hub_cache(cache, "acme/tokenizer-only", tok_dir)
    with pytest.raises(ModelPathError, match=rf"^model\.path: hub snapshot {snapshot} of acme/tokenizer-only "
                                             r"\(revision main\) has no config\.json; "):
        resolve_model_path("acme/tokenizer-only")


def test_incomplete_snapshot_is_named(tmp_path, model, hub_env):
    """huggingface_hub records each commit's file list; a snapshot missing one of those files
    (an interrupted download) is refused rather than half-loaded."""
    tree_cache = pytest.importorskip("huggingface_hub._tree_cache")
    _, ckpt = model
    cache = str(tmp_path / "cache")
    hub_env.setenv("HF_HUB_CACHE", cache)
    snapshot = make_hub_cache(cache, REPO, ckpt)
    files = sorted(os.listdir(snapshot)) + ["model-00002-of-00002.safetensors"]
    tree_cache.write_tree_cache(os.path.dirname(os.path.dirname(snapshot)), os.path.basename(snapshot),
                                {f: tree_cache.TreeCacheEntry(size=1, blob_id="0" * 40) for f in files})
    with pytest.raises(ModelPathError, match=rf"cached snapshot {snapshot} of hub model {REPO} \(revision main\) "
                                             r"is incomplete"):
        resolve_model_path(REPO)


def test_hub_cache_dir_follows_huggingface_hub_precedence(tmp_path):
    """Same answer as huggingface_hub.constants.HF_HUB_CACHE for every combination of variables
    (compared in a fresh interpreter: the constants are read once, at import)."""
    code = r"""
import importlib, json, os, sys
import huggingface_hub.constants as c
from realflow.base.hf_models import hub_cache_dir
names = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")
bad = []
for case in json.loads(sys.argv[1]):
    for n in names:
        os.environ.pop(n, None)
    os.environ.update(case)
    importlib.reload(c)
    if c.HF_HUB_CACHE != hub_cache_dir():
        bad.append([case, c.HF_HUB_CACHE, hub_cache_dir()])
print(json.dumps(bad))
"""
    t = str(tmp_path)
    cases = [{}, {"HF_HUB_CACHE": t + "/a"}, {"HF_HOME": t + "/h"}, {"XDG_CACHE_HOME": t + "/x"},
             {"HUGGINGFACE_HUB_CACHE": t + "/legacy"}, {"HF_HOME": "~/h"}, {"HF_HUB_CACHE": "~/c"},
             {"HF_HUB_CACHE": t + "/a", "HF_HOME": t + "/h", "XDG_CACHE_HOME": t + "/x"},
             {"HF_HOME": t + "/h", "XDG_CACHE_HOME": t + "/x"},
             {"HUGGINGFACE_HUB_CACHE": t + "/legacy", "HF_HUB_CACHE": t + "/a"}]
    out = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# --------------------------------------------------------------------------- architectures


def test_supported_list_is_what_parallel_builds():
    """The launcher's list may not drift from parallel/: causal LMs (model_config), critics (critic)."""
    import transformers

    from parallel.critic import CRITIC_CLASSES
    from parallel.model_config import SUPPORTED_MODEL_TYPES as PARALLEL_TYPES

    assert SUPPORTED_MODEL_TYPES == set(PARALLEL_TYPES)
    critics = {a: t for a, t in SUPPORTED_ARCHITECTURES.items() if a.endswith("ForTokenClassification")}
    assert critics == {a: t for t, a in CRITIC_CLASSES.items()}
    lms = {a: t for a, t in SUPPORTED_ARCHITECTURES.items() if a not in critics}
    assert sorted(lms.values()) == sorted(PARALLEL_TYPES)
    assert all(a.endswith("ForCausalLM") or a.endswith("VLForConditionalGeneration") for a in lms)
    for arch, model_type in SUPPORTED_ARCHITECTURES.items():
        assert getattr(transformers, arch).config_class.model_type == model_type
    line = describe_supported()
    assert "\n" not in line
    assert line.startswith("Qwen2/Qwen2.5 (Qwen2ForCausalLM), Qwen3 (Qwen3ForCausalLM), Llama 3.x (LlamaForCausalLM)")


def test_supported_configs_pass(model):
    from parallel.critic import critic_hf_config
    from parallel.model_config import hf_arch

    _, ckpt = model
    config = json.load(open(os.path.join(ckpt, "config.json")))
    check_architecture(config, ckpt)
    check_architecture(critic_hf_config(config), ckpt)
    check_architecture({"model_type": "llama"}, "x")  # no architectures: model_type decides
    assert hf_arch(config).model_type == "qwen2"  # and the fixture passes parallel's own gate


def test_unsupported_architecture_is_one_line_with_the_supported_list(model, tmp_path):
    _, ckpt = model
    bad = make_unsupported_checkpoint(str(tmp_path / "mamba"), ckpt)
    config = json.load(open(os.path.join(bad, "config.json")))
    with pytest.raises(UnsupportedArchitectureError) as e:
        check_architecture(config, bad)
    assert str(e.value) == (f"{bad}: architecture MambaForCausalLM is not supported (model_type 'mamba'); realflow builds "
                            + ", ".join(SUPPORTED_ARCHITECTURES))
    assert os.path.isfile(os.path.join(bad, "model.safetensors"))  # a copy, not just a config
    fresh = make_unsupported_checkpoint(str(tmp_path / "fresh"), architecture="GPT2LMHeadModel", model_type="gpt2")
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(os.listdir(fresh))
    with pytest.raises(UnsupportedArchitectureError, match="architecture GPT2LMHeadModel is not supported"):
        check_architecture(json.load(open(os.path.join(fresh, "config.json"))), fresh)
    with pytest.raises(UnsupportedArchitectureError, match=r"^c: model_type 'mistral' is not supported; realflow "
                                                           r"builds Qwen2ForCausalLM, "):
        check_architecture({"model_type": "mistral"}, "c")
    with pytest.raises(UnsupportedArchitectureError, match=r"architecture Qwen2ForCausalLM needs model_type 'qwen2' "
                                                           r"but config.json says 'llama'"):
        check_architecture({"architectures": ["Qwen2ForCausalLM"], "model_type": "llama"}, "c")
    with pytest.raises(UnsupportedArchitectureError, match="neither architectures nor model_type"):
        check_architecture({}, "c")
    with pytest.raises(UnsupportedArchitectureError, match="Qwen2ForSequenceClassification is not supported"):
        check_architecture({"architectures": ["Qwen2ForSequenceClassification"], "model_type": "qwen2"}, "c")


@pytest.mark.parametrize("config,expected", [
    ({"max_position_embeddings": 256}, 256),
    ({"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, 4096),
    # Llama 3.1: the extended window is already max_position_embeddings
    ({"max_position_embeddings": 131072, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}}, 131072),
    # Qwen2.5 with YaRN as its model card adds it
    ({"max_position_embeddings": 32768, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}, 131072),
    ({"max_position_embeddings": 2048, "rope_scaling": {"type": "linear", "factor": 2.0}}, 4096),
    ({"hidden_size": 64}, None),
    ({"max_position_embeddings": "long"}, None),
])
def test_model_context_length(config, expected):
    assert model_context_length(config) == expected


# --------------------------------------------------------------------------- what users load


def test_transformers_loads_the_resolved_hub_model_and_its_chat_template(hub, hub_env, model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    from realflow.base.tokenizer_loading import load_tokenizer

    hub_env.setenv("HF_HUB_CACHE", hub["cache"])
    path = resolve_model_path(REPO)
    _, local = model
    from_hub = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    from_dir = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32).eval()
    assert type(from_hub).__name__ == "Qwen2ForCausalLM"
    tokenizers = [PreTrainedTokenizerFast.from_pretrained(path), AutoTokenizer.from_pretrained(path),
                  load_tokenizer(path)]
    assert type(tokenizers[1]).__name__ == "Qwen2Tokenizer"  # as for a real Qwen2.5 download
    tok = tokenizers[0]
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == (IM_END, "<|endoftext|>", None)
    assert from_hub.config.eos_token_id == tok.eos_token_id and from_hub.config.vocab_size == len(tok)

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 30?"}]
    system = "<|im_start|>system\nBe brief.<|im_end|>\n"
    expected = system + "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n"
    text = "Héllo wörld 12345 don't\n\n  tabs\tand   spaces"
    for t in tokenizers:
        assert t.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected
        assert t.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=True) == expected[len(system):]
        assert t(text)["input_ids"] == tok(text)["input_ids"]
        assert t.decode(t(text)["input_ids"]) == text
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert tok.decode(ids) == expected and ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    with torch.no_grad():
        x = torch.tensor([ids])
        assert torch.equal(from_hub(x).logits, from_dir(x).logits)


def test_assistant_tokens_mask_covers_the_reply_and_its_end(model):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(model[0])
    messages = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello! 42"},
                {"role": "user", "content": "Again."}, {"role": "assistant", "content": "Hi."}]
    out = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == f"Hello! 42{IM_END}Hi.{IM_END}"
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False)
    assert "{% generation %}" not in chatml_template() and "{% generation %}" in chatml_template(assistant_mask=True)


def test_tokenizer_is_deterministic(tmp_path, model):
    a = make_chat_tokenizer(str(tmp_path / "a"), assistant_mask=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert open(os.path.join(a, name)).read() == open(os.path.join(model[0], name)).read(), name


def test_every_experiment_refuses_an_unsupported_model_in_one_line(tmp_path_factory, tmp_path):
    """model.path of a model realflow cannot build: one line naming it, from every entry point."""
    _, ckpt = shared_chat_model(tmp_path_factory)
    bad = make_unsupported_checkpoint(str(tmp_path / "mamba"), ckpt)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for app in ("main_sft", "main_sync_ppo", "main_async_ppo"):
        res = subprocess.run([sys.executable, "-m", f"realflow.apps.{app}", f"model.path={bad}",
                              f"fileroot={tmp_path / 'root'}", "--dry-run"], cwd=repo, capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 2, (app, res.stdout, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "MambaForCausalLM is not supported" in lines[0], (app, res.stderr)
