"""Feasibility study: how fast does a tiny Qwen2 learn the arithmetic task on a CPU thread or two?

Why it exists: the default SFT job must show a large held-out accuracy gain in
minutes on a 2-core machine, and still leave room for RL afterwards. This
script measures the two numbers that decide the recipe -- training tokens per
second and greedy exact-match accuracy over wall-clock -- with plain PyTorch +
transformers, i.e. without any framework overhead (an upper bound for realflow).

    python -m experiments.tasks.feasibility                       # the default recipe, 1 thread
    python -m experiments.tasks.feasibility --world 2             # 2 ranks x 1 thread, gloo DDP
    python -m experiments.tasks.feasibility --difficulty 3 --steps 1500 --hidden 192 --heads 6
    python -m experiments.tasks.feasibility --task worked --n-test 500 --steps 550 --micro 4

Prints one line per evaluation and a final JSON summary (``--out`` saves it).

Measured (session 1, 2-core VM shared with other jobs, torch 2.13 CPU, transformers 5):
the default recipe -- difficulty 2, reverse-digit solutions, Qwen2 hidden 128 x 3
layers, 4 heads / 2 KV heads, MLP 352, tied embeddings, 0.57M parameters, vocab 105,
global batch 128, AdamW lr 2e-3 (warmup 50, cosine to 10%), 600 steps = 77k sequences
= 0.91M tokens (21% more as padding) -- trains at ~14k tokens/s on one idle thread and
goes from 0% to 76-86% greedy exact match on 200 held-out prompts (3 seeds):

    1 rank,  idle:       step 200: 25% (21 s)  400: 68% (42 s)  600: 76% (63 s)
    2 ranks, half idle:  step 200: 20% (20 s)  400: 58% (49 s)  600: 82% (66 s), 80 s in all
    2 ranks, contended:  step 200: 26% (45 s)  400: 81% (76 s)  600: 86% (106 s)

What stays hard (RL headroom): two-digit x one-digit multiplication (~30-45%) and the
held-out one-digit facts. ``--difficulty 3`` is the harder knob: 60% after 1000 steps
(198 s, 2 ranks, contended), 82% after 1500 steps (353 s, 1 rank, contended), with
3-digit addition still < 35%. Plain "#### answer" targets (``--style direct``) learn
far slower (< 10% after 1500 steps at difficulty 3), hence the reversed digits.

``--task worked`` (``worked_arithmetic.py``, its defaults; accuracy also by number of
steps, 100 new tokens): 68% after 550 steps (192 s, 1 thread), k=1 83% ... k=6 0% --
see that module's doc. ``--micro 4`` cuts padding (same gradient, 4 length-sorted
micro-batches); sorting whole batches by length instead (tried) slowed learning 2x.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch

from experiments.tasks import worked_arithmetic
from experiments.tasks.arithmetic import ensure_dataset
from experiments.tasks.tokenizer import ensure_tokenizer
from mfc.math_reward import verify_answer
from realflow.data.dataset import PromptAnswerDataset, SFTDataset


@dataclass
class Recipe:
    """Defaults: the recipe chosen for the default SFT job (numbers in the module doc)."""
    task: str = "arith"           # "arith" (experiments/tasks/arithmetic.py) or "worked" (worked_arithmetic.py)
    difficulty: int = 2
    style: str = "reverse"
    ops: str = "+-*"
    max_steps: int = worked_arithmetic.MAX_STEPS  # worked task: longest chain, term digits,
    digits: int = worked_arithmetic.DIGITS        # power-law exponent of the number of steps,
    alpha: float = worked_arithmetic.ALPHA        # line format ("aligned" or "compact")
    wstyle: str = worked_arithmetic.STYLE
    n_train: int = 50_000
    n_test: int = 200
    data_seed: int = 0
    hidden: int = 128
    layers: int = 3
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 352
    batch_size: int = 128         # sequences per optimizer step (global)
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    steps: int = 600
    weight_decay: float = 0.01
    eval_every: int = 100         # steps; also evaluated at step 0 and at the end
    max_new_tokens: int = 0       # greedy eval budget; 0 = 16 (arith) / 100 (worked)
    micro: int = 1                # split each batch into this many length-sorted micro-batches (less padding)
    seed: int = 1
    threads: int = 1
    data_dir: str = "/tmp/realflow_feasibility"
    save_dir: str = ""            # if set: save an HF checkpoint there and re-check it


def lr_at(step: int, r: Recipe) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr`` at ``steps``."""
    if step < r.warmup_steps:
        return r.lr * (step + 1) / r.warmup_steps
    t = min(1.0, (step - r.warmup_steps) / max(1, r.steps - r.warmup_steps))
    return r.lr * (r.min_lr_ratio + (1 - r.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def build_model(r: Recipe, vocab_size: int, tok) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=r.hidden, num_hidden_layers=r.layers,
                      num_attention_heads=r.heads, num_key_value_heads=r.kv_heads,
                      intermediate_size=r.intermediate, max_position_embeddings=128,
                      tie_word_embeddings=True, rope_theta=10000.0,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(r.seed)
    return Qwen2ForCausalLM(cfg)


def collate(batch, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad; labels are -100 on prompt and padding so only responses are learnt."""
    n = max(len(s.input_ids) for s in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), n), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, s in enumerate(batch):
        L = len(s.input_ids)
        ids[i, :L] = torch.tensor(s.input_ids)
        mask[i, :L] = 1
        labels[i, :L] = torch.tensor([-100 if m else t for t, m in zip(s.input_ids, s.prompt_mask)])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@torch.no_grad()
def evaluate(model, tok, test: PromptAnswerDataset, max_new_tokens: int = 16, chunk: int = 256) -> dict:
    """Greedy decoding of every held-out prompt; exact match via the math reward."""
    model.eval()
    samples, texts = list(test), []
    for i in range(0, len(samples), chunk):
        prompts = [s.prompt_ids for s in samples[i:i + chunk]]
        n = max(map(len, prompts))
        ids = torch.tensor([[tok.pad_token_id] * (n - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        texts += tok.batch_decode(out[:, n:], skip_special_tokens=True)
    by_cat: dict[str, list[float]] = defaultdict(list)
    rewards = []
    for s, text in zip(samples, texts):
        rew = verify_answer(text, s.answer, allow_last_number=False).reward
        rewards.append(rew)
        cat = f"k{s.meta['steps']:02d}" if "steps" in s.meta else f"{s.meta.get('op')}{s.meta.get('digits')}"
        by_cat[cat].append(rew)
    model.train()
    return {"acc": sum(rewards) / len(rewards),
            "by_cat": {k: round(sum(v) / len(v), 3) for k, v in sorted(by_cat.items())},
            "sample": texts[:3]}


def save_and_check(model, tok, test: PromptAnswerDataset, path: str, acc: float, max_new_tokens: int) -> None:
    """Save model + tokenizer as a Hugging Face checkpoint, reload both with the
    Auto* classes and require the same greedy accuracy (what later stages rely on)."""
    from transformers import AutoModelForCausalLM

    from realflow.base.tokenizer_loading import load_tokenizer

    model.save_pretrained(path)
    tok.save_pretrained(path)
    reloaded = AutoModelForCausalLM.from_pretrained(path)
    acc2 = evaluate(reloaded, load_tokenizer(path), test, max_new_tokens)["acc"]
    print(f"saved {path}: reloaded accuracy {acc2:.3f} (in memory {acc:.3f})", flush=True)
    if abs(acc2 - acc) > 1e-9:
        raise RuntimeError(f"reloaded checkpoint {path} scores {acc2}, expected {acc}")


def prepare(r: Recipe):
    """Data set and tokenizer (cached on disk; call once before starting ranks)."""
    from transformers import AutoTokenizer

    if r.task == "worked":
        name = (f"worked-k{r.max_steps}-d{r.digits}-a{r.alpha:g}-{r.wstyle}-s{r.data_seed}-n{r.n_train}"
                f"-t{r.n_test}")
        data = worked_arithmetic.ensure_dataset(os.path.join(r.data_dir, name), r.n_train, r.n_test,
                                                r.data_seed, r.max_steps, r.digits, r.alpha, r.wstyle)
    elif r.task == "arith":
        name = f"arith-d{r.difficulty}-{r.style}-{r.ops.replace('*', 'x')}-s{r.data_seed}-n{r.n_train}"
        data = ensure_dataset(os.path.join(r.data_dir, name), r.n_train, r.n_test, r.data_seed,
                              r.difficulty, r.ops, r.style)
    else:
        raise ValueError(f"unknown task {r.task!r} (arith, worked)")
    tok_dir = ensure_tokenizer(os.path.join(r.data_dir, name, "tokenizer"), [data.train])
    return data, AutoTokenizer.from_pretrained(tok_dir)


def response_lengths(tok, path: str) -> dict:
    """p50/p90/p99/max of the reference solutions' lengths in task tokens (without EOS)."""
    with open(path) as f:
        sols = [json.loads(line)["solution"] for line in f]
    n = sorted(len(x) for x in tok(sols, add_special_tokens=False)["input_ids"])
    q = {f"p{int(p * 100)}": n[min(len(n) - 1, int(p * len(n)))] for p in (0.5, 0.9, 0.99)}
    return {**q, "max": n[-1], "mean": round(sum(n) / len(n), 1), "p99/p50": round(q["p99"] / q["p50"], 2)}


def run(r: Recipe, rank: int = 0, world: int = 1) -> dict | None:
    """Train (data-parallel over ``world`` gloo ranks if > 1); rank 0 evaluates and
    returns the summary. ``batch_size`` is the global batch."""
    torch.set_num_threads(r.threads)
    data, tok = prepare(r)
    max_prompt, max_seq = (64, 128) if r.task == "worked" else (32, 48)
    max_new = r.max_new_tokens or (100 if r.task == "worked" else 16)
    train = SFTDataset.load(data.train, tok, max_prompt_len=max_prompt, max_seq_len=max_seq, seed=r.seed)
    train_shard = train.shard(rank, world, even=True)
    test = PromptAnswerDataset.load(data.test, tok, max_prompt_len=max_prompt)
    model = build_model(r, len(tok), tok)
    net = model
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(model)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": r.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=r.lr, betas=(0.9, 0.98))
    if rank == 0:
        print(f"params={n_params} vocab={len(tok)} world={world} train={train.report} test={len(test)} "
              f"response_len={response_lengths(tok, data.test)}", flush=True)

    history, step, epoch, train_s, tokens, padded = [], 0, 0, 0.0, 0, 0
    t_start = time.perf_counter()

    def log_eval(loss: float) -> None:
        if rank == 0:
            t = time.perf_counter()
            ev = evaluate(model, tok, test, max_new)
            row = {"step": step, "train_s": round(train_s, 1), "wall_s": round(time.perf_counter() - t_start, 1),
                   "loss": round(loss, 4), "acc": ev["acc"], "eval_s": round(time.perf_counter() - t, 2),
                   "tok_per_s": round(tokens * world / train_s) if train_s else None}
            history.append({**row, "by_cat": ev["by_cat"]})
            print(json.dumps(row), ev["by_cat"], ev["sample"], flush=True)
        if world > 1:
            torch.distributed.barrier()

    log_eval(float("nan"))
    loss_ema = float("nan")
    while step < r.steps:
        for batch in train_shard.iter_batches(r.batch_size // world, epoch, drop_last=True):
            t = time.perf_counter()
            for g in opt.param_groups:
                g["lr"] = lr_at(step, r)
            batch = sorted(batch, key=lambda x: len(x.input_ids))
            n_lab = sum(len(x.input_ids) - sum(x.prompt_mask) for x in batch)
            k = -(-len(batch) // r.micro)
            loss = 0.0
            for i in range(0, len(batch), k):  # same gradient as one padded batch, less padding
                b = collate(batch[i:i + k], tok.pad_token_id)
                logits = net(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
                mb = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten(),
                                                       ignore_index=-100, reduction="sum") / n_lab
                mb.backward()
                loss += mb.item()
                tokens += int(b["attention_mask"].sum())
                padded += b["input_ids"].numel()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            train_s += time.perf_counter() - t
            loss_ema = loss if step == 0 else 0.95 * loss_ema + 0.05 * loss
            step += 1
            if step % r.eval_every == 0 or step == r.steps:
                log_eval(loss_ema)
            if step >= r.steps:
                break
        epoch += 1
    if rank != 0:
        return None
    if r.save_dir:
        save_and_check(model, tok, test, r.save_dir, history[-1]["acc"], max_new)
    return {"recipe": asdict(r), "world": world, "params": n_params, "train_s": round(train_s, 1),
            "tokens": tokens * world, "tok_per_s": round(tokens * world / train_s),
            "pad_frac": round(1 - tokens / padded, 3), "response_len": response_lengths(tok, data.test), "epochs": round(step * r.batch_size / len(train), 2),
            "history": history}


def _rank_main(rank: int, world: int, r: Recipe, port: int, out: str) -> None:
    from datetime import timedelta

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world, timeout=timedelta(seconds=120))
    try:
        summary = run(r, rank, world)
        if summary is not None:
            with open(out, "w") as f:
                json.dump(summary, f)
    finally:
        torch.distributed.destroy_process_group()


def run_data_parallel(r: Recipe, world: int) -> dict:
    """``world`` processes x ``r.threads`` threads, gradients all-reduced over gloo."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    prepare(r)  # build the cached files once, before the ranks race for them
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "summary.json")
        mp.spawn(_rank_main, args=(world, r, port, out), nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f, v in asdict(Recipe()).items():
        ap.add_argument("--" + f.replace("_", "-"), type=type(v), default=v)
    ap.add_argument("--world", type=int, default=1, help="data-parallel processes (gloo)")
    ap.add_argument("--out", default="", help="write the JSON summary here")
    args = vars(ap.parse_args(argv))
    out, world = args.pop("out"), args.pop("world")
    r = Recipe(**args)
    if r.batch_size % world:
        ap.error(f"--batch-size {r.batch_size} must be divisible by --world {world}")
    summary = run(r) if world == 1 else run_data_parallel(r, world)
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}))
    if out:
        with open(out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
