"""The default GRPO step end to end: realflow against a plain PyTorch + transformers loop.

One command:  python benchmarks/bench_e2e_rl.py [--models default,20m] [--steps 6] [--rounds 2]
              [--workload default|long-prompt]

Both sides do the same work from the same checkpoint: ``batch_size`` prompts of the
default RL data set x ``n_samples`` sampled responses (temperature 1, ``max_new_tokens``,
EOS stops a row), the arithmetic rule reward, group-normalised (GRPO) advantages, the PPO
clipped token-level loss with the behaviour log-probs of generation, AdamW with the same
learning rate and clipping, ``n_minibatches`` optimizer steps per batch, micro-batches of at
most ``max_tokens_per_mb`` tokens.  The plain loop is one process using every core:
``model.generate`` for the rollouts, then forward/backward.  realflow runs its launcher with
the experiment's defaults (allocation included).  The two alternate ``--rounds`` times in
this run; each reports the mean step time after a warm-up step.

Models: ``default`` is the embedded default (the SFT checkpoint the default run starts from,
trained first if absent); ``20m`` a ~20M-parameter Qwen2 (random init, the same tokenizer).
Prints seconds per step for each side, the ratio (goals: >= 2x on the default workload, >= 3x
on the long-prompt one), realflow's breakdown and, when the actor logs ``n_tokens`` /
``n_computed_tokens``, the training tokens and FLOPs computed per useful one (padding,
``training.pad_free``; a group's prompt computed once, ``training.shared_prefix``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _realflow_steps import breakdown, run_job  # noqa: E402

EXPERIMENT = "grpo-math"
TWENTY_M = dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                intermediate_size=1408, max_position_embeddings=128)


@dataclass
class Work:
    """What one GRPO step does (read from the experiment's defaults, so both sides agree)."""

    batch_size: int
    n_samples: int
    max_new_tokens: int
    temperature: float
    lr: float
    eps_clip: float
    n_minibatches: int
    max_tokens_per_mb: int
    grad_clip: float
    max_prompt_len: int

    @classmethod
    def from_defaults(cls, experiment: str = EXPERIMENT) -> "Work":
        from realflow.config.cli import import_modules, parse_overrides
        from realflow.api.experiment import experiment_registry

        import_modules(["experiments"])  # registers the experiments
        c = parse_overrides(experiment_registry.get(experiment), [])
        return cls(c.batch_size, c.ppo.n_samples, c.ppo.max_new_tokens, c.ppo.temperature, c.actor_optimizer.lr,
                   c.ppo.eps_clip, c.ppo.n_minibatches, c.max_tokens_per_mb, c.actor_optimizer.gradient_clipping,
                   c.data_args()["max_prompt_len"])


# ---------------------------------------------------------------- the plain loop


class PlainGRPO:
    """A straightforward single-process GRPO loop (what a user would write without realflow)."""

    def __init__(self, model_path: str, data_path: str, work: Work) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(os.cpu_count() or 1)
        self.torch, self.w = torch, work
        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=work.lr, weight_decay=0.0)
        with open(data_path) as f:
            self.rows = [json.loads(line) for line in f if line.strip()]
        self.next_row = 0
        self.phases: dict[str, list[float]] = {"generation": [], "reward + advantages": [], "training": []}
        self.gen_tokens: list[int] = []
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0

    def _prompts(self) -> tuple[list[list[int]], list[str]]:
        out, answers = [], []
        while len(out) < self.w.batch_size:
            row = self.rows[self.next_row % len(self.rows)]
            self.next_row += 1
            ids = self.tok(row["prompt"])["input_ids"]
            if len(ids) <= self.w.max_prompt_len:
                out.append(ids)
                answers.append(str(row["answer"]))
        return out, answers

    def step(self) -> float:
        from mfc.advantages import grpo_advantages
        from mfc.reward import arithmetic_task_reward
        from realflow.api.reward import RewardInput

        torch, w = self.torch, self.w
        t0 = time.perf_counter()
        prompts, answers = self._prompts()
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])  # left padding
        mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
        self.model.eval()
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=mask, do_sample=True, temperature=w.temperature,
                                      top_p=1.0, top_k=0, max_new_tokens=w.max_new_tokens,
                                      num_return_sequences=w.n_samples, pad_token_id=self.pad,
                                      output_logits=True, return_dict_in_generate=True)
        t_gen = time.perf_counter()
        resp = out.sequences[:, width:]
        logits = torch.stack(out.logits, 1).float()
        behav = torch.log_softmax(logits, -1).gather(-1, resp[..., None]).squeeze(-1)
        eos = self.tok.eos_token_id
        ended = (resp == eos).cumsum(1)
        resp_mask = (ended == 0) | ((ended == 1) & (resp == eos))  # tokens up to and with the first EOS
        texts = self.tok.batch_decode(resp.masked_fill(~resp_mask, self.pad), skip_special_tokens=True)
        rewards = torch.tensor([arithmetic_task_reward(RewardInput(str(i), t, answers[i // w.n_samples]))
                                for i, t in enumerate(texts)])
        adv = grpo_advantages(rewards, [w.n_samples] * len(prompts))
        t_adv = time.perf_counter()
        # train: prompt + response rows, right-padded; loss on response tokens only
        p_ids = ids.repeat_interleave(w.n_samples, 0)
        p_mask = mask.repeat_interleave(w.n_samples, 0)
        full = torch.cat([p_ids, resp], 1)
        attn = torch.cat([p_mask, resp_mask.long()], 1)
        self.model.train()
        order = torch.randperm(len(full))
        for mb_rows in order.chunk(w.n_minibatches):
            self.opt.zero_grad(set_to_none=True)
            n_tok = resp_mask[mb_rows].sum().clamp(min=1)
            per_mb = max(1, w.max_tokens_per_mb // full.shape[1])
            for rows in mb_rows.split(per_mb):
                out_logits = self.model(full[rows], attention_mask=attn[rows]).logits[:, width - 1:-1].float()
                logp = torch.log_softmax(out_logits, -1).gather(-1, resp[rows][..., None]).squeeze(-1)
                ratio = (logp - behav[rows]).exp()
                a = adv[rows][:, None]
                loss = -torch.min(ratio * a, ratio.clamp(1 - w.eps_clip, 1 + w.eps_clip) * a)
                (loss * resp_mask[rows]).sum().div(n_tok).backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), w.grad_clip)
            self.opt.step()
        end = time.perf_counter()
        for k, v in zip(self.phases, (t_gen - t0, t_adv - t_gen, end - t_adv)):
            self.phases[k].append(v)
        self.gen_tokens.append(int(resp_mask.sum()))
        return end - t0


def run_plain(model_path: str, data_path: str, work: Work, steps: int) -> tuple[list[float], dict[str, float]]:
    """Step times after one warm-up step, and the mean seconds of each phase (plus generated tokens/s)."""
    loop = PlainGRPO(model_path, data_path, work)
    times = [loop.step() for _ in range(steps + 1)][1:]
    phases = {k: statistics.mean(v[1:]) for k, v in loop.phases.items()}
    phases["generated tokens/s"] = sum(loop.gen_tokens[1:]) / sum(loop.phases["generation"][1:])
    return times, phases


# ---------------------------------------------------------------- models


def ensure_models(root: str, which: list[str]) -> dict[str, list[str]]:
    """Overrides that point realflow at each model (the default: its own SFT start)."""
    out: dict[str, list[str]] = {}
    if "default" in which:
        out["default"] = []
    if "20m" in which:
        from experiments.init_model import TinyArchConfig, ensure_random_checkpoint

        sft = _default_checkpoint(root)
        path = os.path.join(root, "model-20m")
        ensure_random_checkpoint(path, sft, TinyArchConfig(**TWENTY_M), seed=0)
        out["20m"] = [f"model.path={path}"]
    return out


def _default_checkpoint(root: str) -> str:
    path = os.path.join(root, "sft", "trial0", "checkpoints", "default", "final")
    if not os.path.isfile(os.path.join(path, "config.json")):  # the default run trains it first
        run_job(EXPERIMENT, root, "prepare", 1, [])
    return path


def long_prompt_files(root: str, data_path: str, model_path: str, ratio: float = 4.0) -> tuple[str, str, int]:
    """The long-prompt workload: each prompt led by worked examples of the task (other rows'
    prompt and solution, different per prompt) until its median length is ``ratio`` x the
    median solution's; returns (train file, test file, the longest prompt in tokens)."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    with open(data_path) as f:
        rows = [json.loads(line) for line in f if line.strip()][:4000]
    answer = statistics.median(len(tok(r["solution"])["input_ids"]) + 1 for r in rows[:200])  # + EOS
    rng = random.Random(0)
    worked = [f"{r['prompt']}{r['solution']}\n" for r in rows]
    k = 1
    while statistics.median(len(tok("".join(worked[:k]) + r["prompt"])["input_ids"]) for r in rows[:50]) \
            < ratio * answer:
        k += 1
    out_dir = os.path.join(root, "data", "long-prompt")
    os.makedirs(out_dir, exist_ok=True)
    longest = 0
    paths = []
    for name, part in (("train", rows[:-64]), ("test", rows[-64:])):
        paths.append(os.path.join(out_dir, f"{name}.jsonl"))
        with open(paths[-1], "w") as f:
            for r in part:
                prompt = "".join(rng.sample(worked, k)) + r["prompt"]
                longest = max(longest, len(tok(prompt)["input_ids"]))
                f.write(json.dumps({"prompt": prompt, "answer": r["answer"]}) + "\n")
    print(f"long-prompt workload: {k} worked examples before each question, median answer {answer:.0f} tokens, "
          f"prompts up to {longest} tokens")
    return paths[0], paths[1], longest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="default,20m", help="comma-separated: default, 20m")
    ap.add_argument("--steps", type=int, default=6, help="measured steps per side per round (after 1 warm-up)")
    ap.add_argument("--rounds", type=int, default=2, help="realflow / plain alternations")
    ap.add_argument("--fileroot", default="", help="reuse a fileroot (its SFT checkpoint and data)")
    ap.add_argument("--workload", default="default", choices=("default", "long-prompt"),
                    help="long-prompt: worked examples lead each prompt, 4x the answer's length (n = 8)")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for realflow")
    a = ap.parse_args()
    root = a.fileroot or tempfile.mkdtemp(prefix="bench_e2e_rl_")
    work = Work.from_defaults()
    _default_checkpoint(root)
    data = os.path.join(root, "data", "arith-rl-d3-s1", "train.jsonl")
    if not os.path.isfile(data):
        import glob

        data = sorted(glob.glob(os.path.join(root, "data", "*-rl-*", "train.jsonl")))[0]
    extra: list[str] = []
    if a.workload == "long-prompt":
        train, test, longest = long_prompt_files(root, data, _default_checkpoint(root))
        data = train
        work.n_samples, work.max_prompt_len = 8, longest
        extra = [f"dataset.train_path={train}", f"dataset.test_path={test}", f"dataset.max_prompt_len={longest}",
                 "dataset.chat_template=none", "ppo.n_samples=8"]
    print(f"work per step: {work.batch_size} prompts x {work.n_samples} samples, {work.max_new_tokens} new tokens, "
          f"{work.n_minibatches} optimizer steps; {os.cpu_count()} cores")
    summary = {}
    for name, overrides in ensure_models(root, a.models.split(",")).items():
        model_path = overrides[0].split("=", 1)[1] if overrides else _default_checkpoint(root)
        rf_rows: list[dict] = []
        plain: list[float] = []
        plain_phases: list[dict[str, float]] = []
        for r in range(a.rounds):
            rows = run_job(EXPERIMENT, root, f"e2e-{a.workload}-{name}-{r}", a.steps + 1,
                           [*overrides, *extra, *a.overrides])
            rf_rows += rows[1:]
            times, phases = run_plain(model_path, data, work, a.steps)
            plain += times
            plain_phases.append(phases)
        parts = breakdown(rf_rows)
        rf_step, plain_step = parts.pop("step"), statistics.mean(plain)
        gen_tokens = statistics.mean(r.get("actor_train/response_len", 0.0) for r in rf_rows) * work.batch_size \
            * work.n_samples
        n_params = _n_params(model_path)
        print(f"\nmodel {name} ({n_params / 1e6:.2f}M params): realflow {rf_step:.3f} s/step, plain loop "
              f"{plain_step:.3f} s/step -> realflow is {plain_step / rf_step:.2f}x "
              f"(goal {3 if a.workload == 'long-prompt' else 2}x)")
        for part, sec in parts.items():
            print(f"  realflow {part:<46} {sec * 1000:8.1f} ms  {100 * sec / rf_step:5.1f}%")
        print(f"  realflow generated tokens/s inside the step: {gen_tokens / parts['generation']:.0f} "
              f"(benchmarks/bench_generate.py measures the engine alone)")
        computed = sum(r.get("actor_train/n_computed_tokens", 0.0) for r in rf_rows)
        if computed:  # the actor's train steps: token rows the layers ran (training.pad_free) per real token
            useful = sum(r.get("actor_train/n_tokens", 0.0) for r in rf_rows)
            share = f"{useful / computed:.2f}x fewer rows than tokens (shared prompts)" if computed < useful \
                else f"{useful / computed:.1%} real"
            print(f"  realflow training tokens computed / useful: {computed / max(useful, 1.0):.3f} ({share})")
        f_comp = sum(r.get("actor_train/flops_computed", 0.0) for r in rf_rows)
        if f_comp:  # the same in FLOPs (parallel/flops.py): padding, fillers, shared prompts
            f_use = sum(r.get("actor_train/flops_useful", 0.0) for r in rf_rows)
            print(f"  realflow training FLOPs computed / useful: {f_comp / max(f_use, 1.0):.3f} "
                  f"({f_comp / len(rf_rows) / 1e9:.2f} vs {f_use / len(rf_rows) / 1e9:.2f} GFLOP per step)")
        for part in plain_phases[0]:
            v = statistics.mean(p[part] for p in plain_phases)
            print(f"  plain    {part:<46} " + (f"{v:8.0f}" if "/s" in part else f"{v * 1000:8.1f} ms"))
        summary[name] = {"realflow_s": round(rf_step, 4), "plain_s": round(plain_step, 4),
                         "speedup": round(plain_step / rf_step, 3)}
    print(json.dumps(summary))


def _n_params(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    h, n, ffn, v = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    kv = h // c["num_attention_heads"] * c.get("num_key_value_heads", c["num_attention_heads"])
    return v * h + n * (2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h) + h


if __name__ == "__main__":
    main()
