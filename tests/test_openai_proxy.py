"""The OpenAI-compatible proxy, driven by the official ``openai`` client, against a real
generation server process (builtin engine, a tiny random Qwen2 with a real BPE tokenizer)
behind the real rollout controller's server pool.

* chat and text completions, streaming and not, ``n``, ``stop``, ``seed``: what the
  client sees matches the recorded tokens, and the recorded behaviour log-probs equal
  transformers' log-probs of those tokens under the served weights;
* a second turn is spliced onto the first turn's exact token ids (never re-tokenized),
  and both export modes turn the session into the right trajectories;
* ``top_k`` / ``min_p`` (extra body fields) reach the engine: the tokens and log-probs
  recorded follow transformers' logits truncated as asked;
* bad requests get OpenAI-style error bodies with 4xx codes, which the client raises
  as its own exception types.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import torch

from realflow.api.agent import Completion
from realflow.api.agent_session import ExportConfig, session_trajectories
from realflow.api.rollout import RolloutSpec, rollout_to_batch
from realflow.rollout.controller import RolloutController
from realflow.rollout.openai_proxy import OpenAIProxy, ProxyConfig

openai = pytest.importorskip("openai")
torch.set_num_threads(1)
LOGPROB_ATOL = 1e-4
CORPUS = ["347+285=632", "wrong, try again: 12*34=", "tools: calculator\n", '<tool_call>{"name": "calculator", '
          '"arguments": {"expression": "3*4"}}</tool_call>', "<tool_response>12</tool_response>"] * 50


@pytest.fixture(scope="module")
def served(tmp_path_factory, start_gen_server):
    from experiments.tasks.tokenizer import ensure_tokenizer
    from parallel.testing import make_tiny_hf
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("proxy")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(CORPUS))
    tok_dir = ensure_tokenizer(root / "tok", [corpus], vocab_size=160)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    model_dir = str(root / "model")
    _, model = make_tiny_hf(model_dir, seed=3, family="qwen2", vocab_size=160)
    tok.save_pretrained(model_dir)
    url, proc = start_gen_server(model_dir, "--tokenizer", model_dir, "--max-running-requests", "16")
    yield url, tok, model


def _hf_logprobs(model, ids, n_prompt):
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [float(lp[i - 1, ids[i]]) for i in range(n_prompt, len(ids))]


def _run(served, body):
    """Run ``body(proxy, session)`` on a fresh controller + proxy; return its result."""
    url, tok, _ = served

    async def main():
        ctl = RolloutController(RolloutSpec(model_path="m", tokenizer_path="t", dataset_path="d"), [url], None)
        await ctl.start()

        async def generate(ids, params, n, rid):
            seed = params.get("seed")
            outs = await asyncio.gather(*(ctl.pool.complete(f"{rid}-{i}", ids, dict(params, seed=seed + i))
                                          for i in range(n)))
            return [Completion(o.prompt_ids, o.output_ids, o.logprobs, o.versions, o.finish_reason) for o in outs]

        proxy = OpenAIProxy(generate, tok, ProxyConfig(model_name="policy", max_tokens=24))
        await proxy.start()
        try:
            return await body(proxy, proxy.open_session(seed=5))
        finally:
            await proxy.stop()
            await ctl.close()

    return asyncio.run(main())


@pytest.mark.timeout(120)
def test_chat_and_text_completions_record_the_exact_tokens_and_logprobs(served):
    _, tok, model = served

    async def body(proxy, s):
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.key, max_retries=0)
        chat = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "347+285="}],
                                                    n=3, max_tokens=12, temperature=1.0, seed=11, logprobs=True)
        stream = await client.chat.completions.create(model="policy", max_tokens=10, stream=True,
                                                      stream_options={"include_usage": True},
                                                      messages=[{"role": "user", "content": "12*34="}])
        pieces, finish, usage = [], None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                pieces.append(c.delta.content or "")
                finish = c.finish_reason or finish
        text = await client.completions.create(model="policy", prompt="347+", max_tokens=16, stop=["="], seed=2)
        tstream = await client.completions.create(model="policy", prompt="3*4", max_tokens=8, stream=True)
        tpieces = [c.choices[0].text async for c in tstream if c.choices]
        models = await client.models.list()
        return chat, ("".join(pieces), finish, usage), text, "".join(tpieces), models, list(s.records)

    chat, (streamed, finish, usage), text, tstreamed, models, recs = _run(served, body)
    assert [m.id for m in models.data] == ["policy"]
    assert len(chat.choices) == 3 and chat.id.startswith("chatcmpl-")
    assert len(recs) == 3 + 1 + 1 + 1
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": "347+285="}], tokenize=False,
                                         chat_template=proxy_template())
    assert recs[0].prompt_ids == tok.encode(prompt_ids, add_special_tokens=False)
    for ch, rec in zip(chat.choices, recs[:3]):
        assert rec.id == chat.id and rec.choice == ch.index
        assert ch.message.content == tok.decode(rec.output_ids, skip_special_tokens=True)
        assert [c.logprob for c in ch.logprobs.content] == pytest.approx(rec.logprobs)
        ref = _hf_logprobs(model, rec.prompt_ids + rec.output_ids, len(rec.prompt_ids))
        assert max(abs(a - b) for a, b in zip(rec.logprobs, ref)) < LOGPROB_ATOL
        assert set(rec.versions) == {0}
    assert chat.usage.completion_tokens == sum(len(r.output_ids) for r in recs[:3])
    assert streamed == tok.decode(recs[3].output_ids, skip_special_tokens=True)
    assert finish in ("stop", "length") and usage.completion_tokens == len(recs[3].output_ids)
    # stop strings: the text ends before the stop, the recorded tokens keep what was generated
    t = text.choices[0].text
    assert "=" not in t and tok.decode(recs[4].output_ids, skip_special_tokens=True).startswith(t)
    assert tstreamed == tok.decode(recs[5].output_ids, skip_special_tokens=True)


def proxy_template():
    from realflow.rollout.chat_tokens import PLAIN_CHAT_TEMPLATE

    return PLAIN_CHAT_TEMPLATE


@pytest.mark.timeout(120)
def test_second_turn_is_spliced_on_the_first_turns_tokens_and_both_exports_are_exact(served):
    _, tok, model = served

    async def body(proxy, s):
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.key, max_retries=0)
        msgs = [{"role": "user", "content": "347+285="}]
        r1 = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=8, seed=1)
        msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
                 {"role": "user", "content": "wrong, try again: 347+285="}]
        r2 = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=8, seed=2)
        fresh = await client.chat.completions.create(model="policy", max_tokens=4,
                                                     messages=[{"role": "user", "content": "3*4="}])
        return r1, r2, fresh, list(s.records)

    r1, r2, fresh, recs = _run(served, body)
    a, b, c = recs
    assert b.parent == a.order and c.parent is None
    assert b.prompt_ids[:len(a.prompt_ids) + len(a.output_ids)] == a.prompt_ids + a.output_ids
    assert tok.decode(b.prompt_ids[len(a.prompt_ids) + len(a.output_ids):]).endswith("wrong, try again: 347+285=")
    a.reward = 0.5  # set through the proxy in the agent test; here directly
    conv = session_trajectories(recs, 1.0, ExportConfig("conversation"))
    assert len(conv) == 2  # the two-turn conversation, and the unrelated one
    t = conv[0]
    assert t.input_ids == b.prompt_ids + b.output_ids and t.reward == pytest.approx(1.5)
    gen = [i for i, g in enumerate(t.generated) if g]
    na, nb = len(a.prompt_ids), len(b.prompt_ids)
    assert gen == list(range(na, na + len(a.output_ids))) + list(range(nb, nb + len(b.output_ids)))
    assert [t.logprobs[i] for i in gen] == a.logprobs + b.logprobs
    # the behaviour log-probs of both turns are those of the whole sequence under the model
    full = _hf_logprobs(model, t.input_ids, 1)
    assert max(abs(full[i - 1] - t.logprobs[i]) for i in gen) < LOGPROB_ATOL
    per = session_trajectories(recs, 1.0, ExportConfig("completion", turn_discount=0.5))
    assert [p.reward for p in per] == pytest.approx([0.5 + 0.5 * 0.5 * 1.0, 0.5 * 1.0, 1.0])
    assert per[1].input_ids == b.prompt_ids + b.output_ids and sum(per[1].generated) == len(b.output_ids)
    batch = rollout_to_batch("s0", conv, 0)  # what goes to the trainer
    assert batch.metadata["version_newest"] == [0]


@pytest.mark.timeout(120)
def test_bad_requests_get_openai_errors(served):
    async def body(proxy, s):
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.key, max_retries=0)
        errs = {}
        msgs = [{"role": "user", "content": "1+1="}]
        for name, call in {
            "unknown_model": lambda: client.chat.completions.create(model="gpt-9", messages=msgs),
            "negative_max_tokens": lambda: client.chat.completions.create(model="policy", messages=msgs,
                                                                          max_tokens=-3),
            "missing_messages": lambda: client.chat.completions.create(model="policy", messages=[]),
            "penalty": lambda: client.chat.completions.create(model="policy", messages=msgs, presence_penalty=1.0),
            "over_limit": lambda: client.chat.completions.create(model="policy", messages=msgs, max_tokens=10_000),
            "bad_role": lambda: client.chat.completions.create(model="policy",
                                                               messages=[{"role": "robot", "content": "x"}]),
        }.items():
            try:
                await call()
            except openai.APIStatusError as e:
                errs[name] = (e.status_code, e.body)
        wrong_key = openai.AsyncOpenAI(base_url=s.base_url, api_key="rf-not-a-session", max_retries=0)
        try:
            await wrong_key.chat.completions.create(model="policy", messages=msgs)
        except openai.AuthenticationError as e:
            errs["wrong_key"] = (e.status_code, e.body)
        raw = {}
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {s.key}"}) as http:
            for name, data in {"bad_json": b"{not json", "no_body_messages": json.dumps({"model": "policy"}).encode(),
                               "array_body": b"[1, 2]"}.items():
                async with http.post(s.base_url + "/chat/completions", data=data) as r:
                    raw[name] = (r.status, await r.json())
            async with http.post(s.base_url + "/rl/reward", json={"completion_id": "nope", "reward": 1}) as r:
                raw["reward_unknown"] = (r.status, await r.json())
        return errs, raw, len(s.records)

    errs, raw, n_recorded = _run(served, body)
    assert n_recorded == 0  # nothing bad reached the servers
    assert errs["unknown_model"][0] == 404 and errs["unknown_model"][1]["code"] == "model_not_found"
    assert errs["negative_max_tokens"][0] == 400 and errs["negative_max_tokens"][1]["param"] == "max_tokens"
    assert errs["missing_messages"][0] == 400 and errs["missing_messages"][1]["param"] == "messages"
    assert errs["penalty"][0] == 400 and errs["penalty"][1]["param"] == "presence_penalty"
    assert errs["over_limit"][0] == 400 and "24" in errs["over_limit"][1]["message"]
    assert errs["bad_role"][0] == 400 and errs["bad_role"][1]["param"] == "messages[0].role"
    assert errs["wrong_key"][0] == 401
    for name, (status, b) in raw.items():
        assert 400 <= status < 500 and set(b["error"]) == {"message", "type", "param", "code"}, name
    assert raw["bad_json"][0] == 400 and "JSON" in raw["bad_json"][1]["error"]["message"]
    assert raw["no_body_messages"][1]["error"]["param"] == "messages"
    assert raw["reward_unknown"][0] == 404


@pytest.mark.timeout(120)
def test_top_k_and_min_p_reach_the_engine(served):
    """``top_k`` / ``min_p`` as extra body fields (as vLLM / SGLang take them) are sampled with:
    min_p = 1 or top_k = 1 is greedy at any temperature, and top_k = 3 with min_p = 0.2 draws
    only tokens both keep, recorded with the renormalised behaviour log-probs (T != 1:
    ``logprob_mode="sampling"``), all against transformers' logits."""
    _, tok, model = served

    async def body(proxy, s):
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.key, max_retries=0)
        for extra, t, seed in (({"min_p": 1.0}, 1.8, 1), ({"top_k": 1}, 1.8, 2), ({"top_k": 3, "min_p": 0.2}, 1.5, 3)):
            await client.completions.create(model="policy", prompt="347+", max_tokens=12, temperature=t, seed=seed,
                                            extra_body=extra)
        errs = {}
        for name, extra in (("min_p", {"min_p": 2}), ("top_k", {"top_k": -5})):
            try:
                await client.completions.create(model="policy", prompt="347+", max_tokens=4, extra_body=extra)
            except openai.BadRequestError as e:
                errs[name] = e.body
        return list(s.records), errs

    recs, errs = _run(served, body)
    assert len(recs) == 3
    for i, rec in enumerate(recs):
        ids = rec.prompt_ids + rec.output_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, len(rec.prompt_ids) - 1:-1].double()
        out = torch.tensor(rec.output_ids)
        if i < 2:
            assert out.tolist() == logits.argmax(-1).tolist(), i
            continue
        p = torch.softmax(logits / 1.5, -1)
        keep = (p >= 0.2 * p.max(-1, keepdim=True).values) & (p >= p.topk(3, -1).values[:, -1:])
        assert bool(keep.gather(1, out[:, None]).all()), "a token outside top_k=3 / min_p=0.2 was drawn"
        want = (p.gather(1, out[:, None]).squeeze(1) / (p * keep).sum(-1)).log()
        assert max(abs(a - b) for a, b in zip(rec.logprobs, want.tolist())) < LOGPROB_ATOL
    for name in ("min_p", "top_k"):
        assert errs[name]["param"] == name and errs[name]["message"].startswith(f"Invalid value for '{name}'")


def test_tool_calls_parse_and_resplice_on_the_generated_tokens(served):
    """Tool calls come back re-serialised by the client; the next prompt still extends the
    tokens the model generated (pure: no server needed)."""
    from realflow.rollout.chat_tokens import ChatTokenizer, normalize_messages, parse_tool_calls

    _, tok, _ = served
    ct = ChatTokenizer(tok)
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    msgs = normalize_messages([{"role": "user", "content": "3*4="}])
    text = ct.render(msgs, tools)
    assert text == "<s>tools: calculator\n3*4="
    prompt = ct.splice_chat(msgs, tools, text, [])
    assert prompt.parent is None and prompt.ids == tok.encode(text, add_special_tokens=False)
    generated = tok.encode('<tool_call>{"name":"calculator","arguments":{"expression":"3*4"}}</tool_call>',
                           add_special_tokens=False) + [tok.eos_token_id]
    content, calls = parse_tool_calls(tok.decode(generated, skip_special_tokens=True))
    assert content is None and calls[0]["function"] == {"name": "calculator", "arguments": '{"expression": "3*4"}'}
    reply = {"role": "assistant", "content": None, "tool_calls": calls}
    turn = ct.new_turn(0, msgs, tools, text, prompt.ids, generated, reply)
    # the client sends the call back (as JSON text arguments) with the tool's result
    nxt = normalize_messages(msgs + [reply, {"role": "tool", "tool_call_id": calls[0]["id"], "content": "12"}])
    text2 = ct.render(nxt, tools)
    sp = ct.splice_chat(nxt, tools, text2, [turn])
    assert sp.parent == 0 and sp.ids[:len(prompt.ids) + len(generated)] == prompt.ids + generated
    assert tok.decode(sp.ids[len(prompt.ids) + len(generated):]) == "<tool_response>12</tool_response>"
    # not the same reply (different arguments): a fresh prompt, not a wrong splice
    other = [dict(nxt[0]), {"role": "assistant", "content": None, "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "4*4"}}}]},
        nxt[2]]
    assert ct.splice_chat(other, tools, ct.render(other, tools), [turn]).parent is None
