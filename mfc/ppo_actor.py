"""The PPO actor: generate (with behaviour logprobs), recompute logprobs, clipped-PPO train step.

``generate`` samples with the engine's own generator (``model.module.generator``, see
:class:`realflow.api.engine.TrainEngine`) on the weights of the MFC's layout (the built-in
engine shares the parameters, so a reallocation into this layout is seen without
copying). ``train_step`` computes advantages (:mod:`mfc.rl_batch`), then runs
``ppo_epochs`` x ``n_minibatches`` optimizer steps of the clipped (optionally dual-clip
or decoupled) objective. ``evaluate`` scores greedy and sampled responses to held-out prompts
(final-answer exact match, or the registered reward ``eval_reward``, e.g. ``code-tests``).
"""
from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from mfc.images import has_images, sample_images, sequence_images
from mfc.losses import aggregation_weight, ppo_actor_loss
from mfc.mismatch import gap_means, gap_stats
from mfc.packed import next_token_targets
from mfc.ppo_config import PPOConfig
from mfc.reward import held_out_scores
from mfc.rl_batch import WORK_KEYS, KLPenalty, flat_seqlens, run_ppo_updates
from realflow.api.batch import MicroBatchSpec, SequenceBatch
from realflow.api.config_values import dict_to_config
from realflow.api.engine import GENERATOR_SETTINGS
from realflow.api.generation import SamplingParams
from realflow.api.interface import Model, ModelInterface, register_interface
from realflow.api.keys import (INPUT_IDS, LOGPROBS, NO_EOS, PROMPT_MASK, PROMPTS, PROX_LOGPROBS, REF_LOGPROBS,
                               ROUTED_EXPERTS, VERSIONS)
from realflow.api.routing import routed_experts_tensor


@register_interface("ppo_actor")
@dataclass
class PPOActorInterface(ModelInterface):
    n_samples: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0  # != 1: behaviour and trained logprobs are both of the tempered policy
    # truncation (see _sampling): top_p in (0, 1], top_k -1 = off, min_p in [0, 1] (0 = off)
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)  # stop strings (the response keeps them)
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's eos
    seed: int = 1
    # the knobs of the loss, the advantages and the update schedule (mfc.ppo_config); a dict of
    # its fields (interface arguments travel as plain data) becomes a PPOConfig when built
    ppo: PPOConfig = field(default_factory=PPOConfig)
    eval_max_new_tokens: int = 16
    eval_n_samples: int = 8  # samples per held-out prompt for sampled_accuracy (0 = greedy only)
    eval_reward: str = ""  # "" = final-answer exact match; else a registered reward (mean = accuracy)
    eval_reward_args: dict[str, Any] = field(default_factory=dict)
    # decoupled PPO (asynchronous runs, and synchronous ones with ppo.recompute_logprobs): clip against
    # the proximal policy (key PROX_LOGPROBS, from actor_inf) and weight each token by pi_prox / pi_behav,
    # corrected by ppo.mismatch_correction and capped at ppo.behav_imp_weight_cap
    decoupled: bool = False
    # the engine's own generator: KV-cache memory and engine settings (ppo.gpu_memory_utilization,
    # ppo.max_model_len, ppo.enforce_eager, ppo.kv_block_size, ppo.prefix_sharing; None = the engine's defaults)
    gpu_memory_utilization: Optional[float] = None
    max_model_len: Optional[int] = None
    enforce_eager: Optional[bool] = None
    kv_block_size: Optional[int] = None
    prefix_sharing: Optional[bool] = None

    def __post_init__(self) -> None:
        # bad sampling settings fail when the interface is built, not at the first generate
        sp = SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                            stop=self.stop, stop_token_ids=self.stop_token_ids).validate()
        self.stop, self.stop_token_ids = sp.stop, sp.stop_token_ids  # a single string -> [string]
        self.ppo = knobs_for(self.ppo, self.max_new_tokens)
        self.kl = KLPenalty(self.ppo)
        self._step = 0

    # ---- generate -------------------------------------------------------------------------------
    def generate(self, model: Model, batch: SequenceBatch, mb_spec: MicroBatchSpec) -> SequenceBatch:
        tok = model.tokenizer
        prompts = [batch.sequences(PROMPTS, i)[0].tolist() for i in range(len(batch))]
        gen = model.module.generator(max(map(len, prompts), default=1) + self.max_new_tokens,
                                     version=model.version, tokenizer=tok, **self._generator_settings())
        # seeds: reproducible per (run seed, weight version, sample)
        params = [self._sampling(tok, self.n_samples, zlib.crc32(f"{self.seed}/{model.version}/{sid}".encode()))
                  for sid in batch.ids]
        kw = {"images": [sample_images(batch, i) for i in range(len(batch))]} if has_images(batch) else {}
        results = gen.generate(prompts, params, **kw)
        ids, pmask, lps, no_eos, routed = [], [], [], [], []
        moe = bool(results) and all(r.routed_experts is not None for r in results)  # routing replay (R3)
        for i in range(len(batch)):
            g_ids, g_pm, g_lp, g_ne = [], [], [], []
            for r in results[i * self.n_samples:(i + 1) * self.n_samples]:
                p, o = list(r.prompt_ids), list(r.output_ids)
                g_ids.append(torch.tensor(p + o, dtype=torch.long))
                g_pm.append(torch.tensor([1] * len(p) + [0] * len(o), dtype=torch.bool))
                lp = torch.zeros(len(p) + len(o), dtype=torch.float32)
                if o:  # logprob of output j (position len(p)+j) belongs to position len(p)+j-1
                    lp[len(p) - 1:len(p) - 1 + len(o)] = torch.tensor(r.output_logprobs, dtype=torch.float32)
                g_lp.append(lp)
                g_ne.append(torch.tensor([float(r.finish_reason.get("type") == "length")]))
            if moe:
                routed.append([routed_experts_tensor(r.routed_experts, len(r.prompt_ids) + len(r.output_ids))
                               for r in results[i * self.n_samples:(i + 1) * self.n_samples]])
            ids.append(g_ids)
            pmask.append(g_pm)
            lps.append(g_lp)
            no_eos.append(g_ne)
        data = {INPUT_IDS: ids, PROMPT_MASK: pmask, LOGPROBS: lps, NO_EOS: no_eos}
        if moe:
            data[ROUTED_EXPERTS] = routed
        return SequenceBatch.from_samples(batch.ids, data)

    def _sampling(self, tok: Any, n: int, seed: int) -> SamplingParams:
        """How responses are sampled (training and held-out pass@1 alike).

        Top-p / top-k / min-p draw from a truncation of the tempered policy that the loss
        trains (``logprobs(..., temperature)`` sees the whole vocabulary): the behaviour
        policy differs from the trained one on the cut tokens. Behaviour log-probs are the
        untruncated ones at T = 1 (``raw``, what the trainer recomputes) and the exact
        truncated, renormalised ones otherwise (``sampling``); the loss is unchanged.
        """
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, n=n, seed=seed, stop=list(self.stop),
                              stop_token_ids=self._stop_ids(tok),
                              logprob_mode="raw" if self.temperature == 1.0 else "sampling")

    def _generator_settings(self) -> dict[str, Any]:
        """The generator keys the user set (only those: an engine written before them still works)."""
        return {k: getattr(self, k) for k in GENERATOR_SETTINGS if getattr(self, k) is not None}

    def _stop_ids(self, tok: Any) -> list[int]:
        """The tokenizer's eos, then ``stop_token_ids``."""
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        return eos + [t for t in self.stop_token_ids if t not in eos]

    # ---- inference: logprobs under the current weights -----------------------------------------
    def inference(self, model: Model, batch: SequenceBatch, mb_spec: MicroBatchSpec) -> Optional[SequenceBatch]:
        return logprobs_batch(model, batch, mb_spec, PROX_LOGPROBS, self.temperature)

    # ---- train ----------------------------------------------------------------------------------
    def train_step(self, model: Model, batch: SequenceBatch, mb_spec: MicroBatchSpec) -> dict[str, float]:
        eng = model.module
        t, kl_coef = self.kl.rl_tensors(batch, self.ppo, eng.dp_sum, self.max_new_tokens)
        extra = {}
        if self.decoupled:
            if PROX_LOGPROBS not in batch.data:
                raise ValueError(f"decoupled PPO needs '{PROX_LOGPROBS}' (the proximal policy's logprobs from "
                                 f"actor_inf) among actor_train's inputs")
            extra["_prox_lp"] = batch.data[PROX_LOGPROBS].float()
        if self.ppo.kl_loss_coef():  # KL in the loss: the reference's logprobs go to the micro-batches
            if REF_LOGPROBS not in batch.data:
                raise ValueError(f"kl_in=loss needs '{REF_LOGPROBS}' (the reference model's logprobs) among "
                                 f"actor_train's inputs")
            extra["_ref_lp"] = batch.data[REF_LOGPROBS].float()
        if ROUTED_EXPERTS in batch.data:  # MoE routing replay: the generator's experts per token
            extra[ROUTED_EXPERTS] = batch.data[ROUTED_EXPERTS]
        up = run_ppo_updates(eng, batch, t, mb_spec, epochs=self.ppo.ppo_epochs, n_minibatches=self.ppo.n_minibatches,
                             seed=self.seed, step=self._step, micro_batch=self._micro_batch,
                             loss_fn=self._loss, weight_fn=self._weight, extra_keys=extra)
        totals, n_updates = up.totals, up.n_updates
        # before any update the trainer must see the generator's distribution
        gen_kl = up.first["approx_kl_k3_sum"] / max(up.first["n_loss_tokens"], 1.0)
        gap = self._gap(model, batch, t, up.first)
        self._step += 1
        out = {k: v / n_updates for k, v in totals.items() if k in ("loss", "grad_norm", "lr")}
        out["nonfinite_skipped"] = totals.get("nonfinite_skipped", 0.0)  # updates not applied (on_nonfinite=skip)
        # tokens the updates trained on and the ones they computed (real + padding: training.pad_free)
        out.update({k: totals[k] for k in WORK_KEYS if k in totals})
        n_tok = max(totals.get("n_loss_tokens", 0.0), 1.0)
        for k, name in (("clipped_tokens", "clip_frac"), ("approx_kl_sum", "approx_kl"),
                        ("entropy_sum", "entropy"), ("ratio_sum", "ratio")):
            out[name] = totals.get(k, 0.0) / n_tok
        # k3 KL(behaviour || trainer) on the first mini-batch: ~1e-12 when the reallocated generation
        # weights equal the training weights and both compute the same fp32 logprobs
        out["gen_train_kl"] = gen_kl
        out.update(gap)
        # the step's batch statistics, summed over dp in ONE collective (each costs a round trip)
        names = ["n_seqs", "score_sum", "n_truncated", "n_action_tokens", "neg_logprob_sum", "n_prompt_tokens"]
        local = [t.stats[k] for k in names]
        if "kl_ref_sum" in t.stats:
            names.append("kl_ref_sum")
            local.append(t.stats["kl_ref_sum"])
        for k in ("mismatch_corrected_tokens", "n_loss_tokens", "behav_imp_weight_sum", "behav_capped_tokens"):
            names.append(k)
            local.append(totals.get(k, 0.0))
        red = dict(zip(names, eng.dp_sum(local)))
        if self.ppo.mismatch_correction != "none":
            out["mismatch/corrected_frac"] = red["mismatch_corrected_tokens"] / max(red["n_loss_tokens"], 1.0)
        # MoE: load-balancing loss, expert load and (with replay) how often the trainer's router disagrees
        out.update({k: v / n_updates for k, v in totals.items() if k.startswith("moe/")})
        if self.decoupled:  # how far behaviour and proximal policies were apart (the off-policy gap)
            n_all = red["n_loss_tokens"]
            out["behav_imp_weight"] = red["behav_imp_weight_sum"] / max(n_all, 1.0)
            out["behav_capped_frac"] = red["behav_capped_tokens"] / max(n_all, 1.0)
        n_seqs, n_act = red["n_seqs"], red["n_action_tokens"]
        out["reward"] = red["score_sum"] / max(n_seqs, 1.0)
        out["truncated_frac"] = red["n_truncated"] / max(n_seqs, 1.0)
        out["response_len"] = n_act / max(n_seqs, 1.0)
        # the behaviour policy's entropy per token, estimated from its sampled tokens (free: no extra pass)
        out["sample_entropy"] = red["neg_logprob_sum"] / max(n_act, 1.0)
        # the long tail a synchronous generation waits for, and the prompts (what the planner needs)
        out["response_len_max"] = eng.dp_max([t.stats["response_len_max"]])[0]
        out["prompt_len"] = red["n_prompt_tokens"] / max(n_seqs, 1.0)
        if "kl_ref_sum" in t.stats:
            out["kl_ref"] = red["kl_ref_sum"] / max(n_act, 1.0)
            out["kl_coef"] = kl_coef
        return out

    def _gap(self, model: Model, batch: SequenceBatch, t: Any, first: dict[str, float]) -> dict[str, float]:
        """The step's ``mismatch/*`` stats (:func:`mfc.mismatch.gap_means`): the trainer's log-probs
        before the update against the generator's. With proximal log-probs (decoupled runs) every
        token counts, split by version offset when the batch carries versions; otherwise the first
        update's tokens (one mini-batch), already reduced by the engine."""
        if not self.decoupled or PROX_LOGPROBS not in batch.data:
            return gap_means({k: v for k, v in first.items() if k.startswith("mismatch/")})
        stale = None
        if VERSIONS in batch.data:  # the version offset of each token (its logprob's position)
            stale = model.version - batch.data[VERSIONS].long()
        sums = gap_stats(batch.data[PROX_LOGPROBS].float(), t.old_logprobs, t.action_mask, stale)
        eng = model.module
        keys = sorted(k for k in sums if not k.endswith("_max"))
        reduced = dict(zip(keys, eng.dp_sum([sums[k] for k in keys])))
        maxima = sorted(k for k in sums if k.endswith("_max"))
        reduced.update(zip(maxima, eng.dp_max([sums[k] for k in maxima])))
        return gap_means(reduced)

    @staticmethod
    def _micro_batch(mb: SequenceBatch, lens: list[int]) -> dict:
        targets, _ = next_token_targets(mb.data[INPUT_IDS], lens)
        return {"targets": targets, "mask": mb.data["_mask"].bool(), "old": mb.data["_old_lp"],
                "adv": mb.data["_adv"], "lens": lens, "prox": mb.data.get("_prox_lp"),
                "ref": mb.data.get("_ref_lp")}

    def _loss(self, outputs: Any, extra: dict) -> tuple[torch.Tensor, dict[str, float]]:
        t = self.temperature  # the policy being trained is the one that sampled: pi(.)^(1/T), renormalised
        if self.ppo.entropy_coef:
            lp, ent = outputs.logprobs_and_entropy(extra["targets"], t)
        else:
            lp, ent = outputs.logprobs(extra["targets"], t), None
        ref = extra["ref"].float() if self.ppo.kl_loss_coef() and extra["ref"] is not None else None
        return ppo_actor_loss(lp, extra["old"], extra["adv"], extra["mask"], self.ppo,
                              seqlens=extra["lens"], prox_logprobs=extra["prox"], entropy=ent, ref_logprobs=ref)

    def _weight(self, extra: dict) -> float:
        return float(aggregation_weight(extra["mask"], extra["lens"], self.ppo.loss_agg))

    # ---- evaluation / save ----------------------------------------------------------------------
    def evaluate(self, model: Model, batch: SequenceBatch) -> dict[str, float]:
        """Held-out score of this dp rank's prompts, summed over dp ranks: final-answer exact
        match, or the mean of the registered reward ``eval_reward`` (with ``eval_reward_args``).

        ``accuracy``: greedy decoding. ``sampled_accuracy``: pass@1 estimated as the mean
        score of ``eval_n_samples`` samples per prompt at the training temperature --
        the quantity RL maximises, and the usual headline metric of RL for reasoning --
        with seeds fixed per prompt, so evaluations before and after training compare the
        same random draws.
        """
        eng = model.module
        prompts = [batch.sequences(PROMPTS, i)[0].tolist() for i in range(len(batch))]
        tok = model.tokenizer
        sampled = None
        kw = {"images": [sample_images(batch, i) for i in range(len(batch))]} if has_images(batch) else {}
        if eng.strategy.pp == 1 and not eng.is_critic:
            context = max(map(len, prompts), default=1) + max(self.eval_max_new_tokens, self.max_new_tokens)
            gen = eng.generator(context, version=model.version, tokenizer=tok, **self._generator_settings())
            # greedy: no truncation, but a response ends where a training one would
            res = gen.generate(prompts, SamplingParams(max_new_tokens=self.eval_max_new_tokens, temperature=0.0,
                                                       stop=list(self.stop), stop_token_ids=self._stop_ids(tok)),
                               **kw)
            outputs = [r.output_ids for r in res]
            if self.eval_n_samples:
                params = [self._sampling(tok, self.eval_n_samples, zlib.crc32(f"eval/{self.seed}/{sid}".encode()))
                          for sid in batch.ids]
                res = gen.generate(prompts, params, **kw)
                k = self.eval_n_samples
                sampled = sum(self._scores([r.output_ids for r in res],
                                           [a for a in batch.metadata["answer"] for _ in range(k)], tok))
        else:
            outputs = eng.greedy_generate(prompts, self.eval_max_new_tokens, tok.eos_token_id, **kw)
        correct = sum(self._scores(outputs, batch.metadata["answer"], tok))
        n_correct, n_total, n_sampled = eng.dp_sum([float(correct), float(len(prompts)), float(sampled or 0.0)])
        out = {"accuracy": n_correct / max(n_total, 1.0), "n_eval": n_total}
        if sampled is not None:
            out["sampled_accuracy"] = n_sampled / max(n_total * self.eval_n_samples, 1.0)
        return out

    def _scores(self, outputs: list[list[int]], answers: list[Any], tok: Any) -> list[float]:
        texts = [tok.decode(ids, skip_special_tokens=True) for ids in outputs]
        return held_out_scores(texts, answers, self.eval_reward, self.eval_reward_args)

    def save(self, model: Model, path: str) -> None:
        model.module.save_hf(path, tokenizer_dir=getattr(model.tokenizer, "name_or_path", None))


def knobs_for(ppo: PPOConfig | dict[str, Any], max_new_tokens: int) -> PPOConfig:
    """The interface's knobs: built from plain data when they came as a dict (from the wire), with
    ``loss_agg_norm_len`` defaulting to ``max_new_tokens``, and checked against the generation
    length (a bad overlong buffer fails when the interface is built, not at the first step)."""
    cfg = dict_to_config(PPOConfig, ppo) if isinstance(ppo, dict) else ppo
    if cfg.loss_agg_norm_len is None:
        cfg = dataclasses.replace(cfg, loss_agg_norm_len=float(max_new_tokens))
    cfg.overlong_buffer(max_new_tokens)
    return cfg


def logprobs_batch(model: Model, batch: SequenceBatch, mb_spec: MicroBatchSpec, key: str,
                   temperature: float = 1.0) -> Optional[SequenceBatch]:
    """Per-token logprobs of ``packed_input_ids`` under ``model`` at ``temperature`` (None on
    non-output ranks)."""
    lens = flat_seqlens(batch)
    kw = {}
    if ROUTED_EXPERTS in batch.data:  # MoE routing replay (R3): the generator's experts per token
        kw["routed_experts"] = batch.data[ROUTED_EXPERTS]
    if has_images(batch):  # VL prompts: each sequence's images
        kw["images"] = sequence_images(batch)
    lp = model.module.logprobs(batch.data[INPUT_IDS], lens, mb_spec.max_tokens_per_mb, temperature=temperature, **kw)
    if lp is None:
        return None
    return SequenceBatch(list(batch.ids), {key: batch.seqlens[INPUT_IDS]}, {key: lp.float()})
