"""The phases a step is made of: generation parameters, rewards, old/reference log-probs with
rollout correction, advantages, the actor update, the memory hand-off between the pools, the
batch metrics, and validation. :class:`~megarl.trainer.step.Trainer` calls them in order."""

from __future__ import annotations

from typing import Any

import torch

from megarl.algo import (
    apply_kl_in_reward,
    compute_advantages,
    compute_rollout_correction,
    outcome_to_token_rewards,
    rollout_probs_diff_metrics,
    router_agreement,
)
from megarl.batch import StepBatch, even_shares
from megarl.metrics.timing import reduce_metrics, throughput_metrics
from megarl.rollout.agent import agent_metrics
from megarl.rollout.interface import SamplingParams
from megarl.trainer.base import TrainerBase
from megarl.trainer.critic import CriticTargets, gae_advantages_of


class StepPhases(TrainerBase):
    """The phases of an RL step, each a method the step (and the schedulers) call."""

    def validate(self) -> dict[str, float]:
        """Greedy answers to every validation prompt; mean score overall and per data source."""
        from megarl.data.loader import PromptLoader
        from megarl.reward import RewardSample

        tok, cfg = self.tokenizer, self.cfg
        rows = list(self.val_dataset)
        params = SamplingParams(max_new_tokens=cfg.data.max_response_length, temperature=0.0,
                                n=1, stop_token_ids=[tok.eos_token_id])
        size = cfg.data.val_batch_size or len(rows)
        samples = []
        for batch in PromptLoader(rows, size, shuffle=False, drop_last=False):
            if self.agent is not None:  # greedy episodes, the same tools as in training
                samples += self.on_driver(lambda b=batch: self.run(self.agent.rollout(
                    self.workers.client, b, params, [0] * len(b), {"return_logprob": False})))
                continue
            samples += self.on_driver(lambda b=batch: self.run(self.workers.client.generate(
                [p["input_ids"] for p in b], params, return_logprob=False)))
        result = self.on_driver(lambda: self.rewards.score([
            RewardSample(row["data_source"], tok.decode(s.response_ids, skip_special_tokens=True),
                         row["ground_truth"], row.get("extra_info") or {})
            for row, s in zip(rows, samples)]))
        totals = [x + s.extra.get("agent", {}).get("env_reward", 0.0)
                  for x, s in zip(result.scores, samples)]
        metrics = {"val/score/mean": sum(totals) / len(totals)}
        metrics.update({f"val/{k}": v for k, v in agent_metrics(samples).items()
                        if k.startswith("agent/")})
        for source in sorted({row["data_source"] for row in rows}):
            scores = [x for row, x in zip(rows, totals) if row["data_source"] == source]
            metrics[f"val/{source}/score/mean"] = sum(scores) / len(scores)
        return metrics

    def free_train_cache(self) -> None:
        """Every train-pool process (actor, critic) hands its allocator's cached blocks back to
        the driver, so that colocated engines can resume into them."""
        self.workers.actor.execute_all("free_cache")
        if self.workers.critic is not None:
            self.workers.critic.group.execute_all("free_cache")

    def engine_memory(self, action: str, tags: list[str]) -> None:
        """Release or resume (``action``) the engines' memory regions ``tags`` (SGLang's
        ``/release_memory_occupation`` and ``/resume_memory_occupation``)."""
        client = self.workers.client
        call = client.release_memory if action == "release" else client.resume_memory
        self.on_driver(lambda: self.run(call(tags)))

    def offload_actor(self, parts: list[str]) -> None:
        """Move those of ``parts`` that ``actor.offload`` switches on to host memory (the next
        phase that needs them brings them back)."""
        off = self.cfg.actor.offload
        on = {"param": off.param_offload, "grad": off.grad_offload,
              "optimizer": off.optimizer_offload}
        chosen = [part for part in parts if on[part]]
        if chosen:
            self.workers.actor.execute_all("offload", chosen)

    def sampling_params(self) -> SamplingParams:
        """How every prompt of a training step is sampled (``rollout.n`` samples each)."""
        cfg, tok = self.cfg, self.tokenizer
        stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
        return SamplingParams(max_new_tokens=cfg.data.max_response_length,
                              temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                              top_k=cfg.rollout.top_k, n=cfg.rollout.n, stop_token_ids=stop)

    def generation_options(self) -> dict[str, bool]:
        """What the engines return with every training sample (log-probs; routes for R3)."""
        return {"return_logprob": True,
                "return_routed_experts": bool(self.cfg.rollout.enable_return_routed_experts)}

    def prompt_seeds(self, step_index: int, count: int) -> list[int]:
        """Sampling seeds of the prompts of step ``step_index`` (sample j of a prompt uses
        seed + j): from the run seed and the step, so the samples do not depend on how the
        engines batch requests and a run is reproducible."""
        n = self.cfg.rollout.n
        base = (self.cfg.trainer.seed * 1_000_003 + step_index * 10_007) % 2**31
        return [base + i * n for i in range(count)]

    def score(self, batch: StepBatch) -> dict[str, float]:
        """Rewards of every sample; returns the reward metrics."""
        from megarl.reward import RewardSample

        items = []
        for i, sample in enumerate(batch.samples):
            row = batch.prompts[i // batch.n]
            text = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
            items.append(RewardSample(row["data_source"], text, row["ground_truth"],
                                      row.get("extra_info") or {}))
        result = self.on_driver(lambda: self.rewards.score(items))
        env_rewards = [s.extra.get("agent", {}).get("env_reward", 0.0) for s in batch.samples]
        batch.scores = torch.tensor(result.scores, dtype=torch.float32) + torch.tensor(
            env_rewards, dtype=torch.float32)  # an environment's rewards (multi-turn) add up
        return dict(result.metrics)

    def token_level_rewards(self, batch: StepBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """``[B, T]`` rewards: each sample's score on its last response token, minus beta x the
        per-token KL of the old to the reference log-probs when ``algorithm.use_kl_in_reward``
        is on (then with ``actor/reward_kl_penalty{,_coeff}``; the controller steps once)."""
        if batch.scores is None:
            raise ValueError("token_level_rewards: the batch has no scores; score it first")
        mask = batch.response_mask()
        scores = outcome_to_token_rewards(batch.scores, mask)
        if self.kl_ctrl is None:
            return scores, {}
        if not batch.old_log_probs or batch.ref_log_probs is None:
            raise ValueError("algorithm.use_kl_in_reward: the old and reference log-probs must "
                             "be computed before the advantages")
        return apply_kl_in_reward(scores, batch.padded(batch.old_log_probs),
                                  batch.padded(batch.ref_log_probs), mask, self.kl_ctrl,
                                  self.cfg.algorithm.kl_penalty)

    def compute_advantages(self, batch: StepBatch, values: list[list[float]] | None = None,
                           metrics: dict[str, float] | None = None) -> CriticTargets | None:
        """Advantages per response token (the estimator of ``algorithm.adv_estimator``) from the
        token-level rewards (outcome estimators: their sum per sample; reinforce_plus_plus: the
        token-level rewards themselves); with gae, from the critic's
        ``values``, returning the critic's targets. The KL metrics go into ``metrics``."""
        alg = self.cfg.algorithm
        if alg.adv_estimator == "remax":
            raise ValueError("algorithm.adv_estimator=remax needs a greedy baseline rollout, "
                             "which this trainer does not generate; use grpo, rloo or opo")
        rewards, kl_metrics = self.token_level_rewards(batch)
        if metrics is not None:
            metrics.update(kl_metrics)
        if alg.adv_estimator == "gae":
            if values is None:
                raise ValueError("algorithm.adv_estimator=gae needs the critic's values; set "
                                 "critic.enabled=true (or leave it null)")
            batch.advantages, targets = gae_advantages_of(batch, values, gamma=alg.gamma,
                                                          lam=alg.lam, token_level_rewards=rewards)
            return targets
        mask = batch.response_mask()
        if alg.adv_estimator == "reinforce_plus_plus":  # token-level: returns-to-go, whitened
            inputs: dict[str, Any] = {"token_level_rewards": rewards * mask,
                                      "response_mask": mask, "gamma": alg.gamma}
        else:  # outcome estimators over the groups of one prompt
            inputs = {"scores": (rewards * mask).sum(dim=-1), "response_mask": mask,
                      "index": batch.group_index()}
        if alg.adv_estimator in ("grpo", "grpo_passk"):
            inputs["norm_adv_by_std_in_grpo"] = alg.norm_adv_by_std_in_grpo
        batch.advantages, _ = compute_advantages(alg.adv_estimator, **inputs)
        return None

    def compute_log_probs(self, batch: StepBatch, use_ref: bool = False,
                          routes: list[torch.Tensor] | None = None,
                          record_routes: bool = False) -> dict[str, list]:
        """Trainer log-probs (response part) of every sample, computed over the DP ranks.
        ``routes`` (per sample, rows aligned with ``batch.sequences()``) are replayed; with
        ``record_routes`` the result's ``routes`` are the ones the forward used."""
        w = self.workers
        sequences = batch.sequences()
        shares = even_shares(len(sequences), w.dp_size)
        per_rank = [([sequences[i] for i in share], use_ref, False,
                     None if routes is None else [routes[i] for i in share], record_routes)
                    for share in (shares[w.dp_rank[r]] for r in range(w.actor.world_size))]
        results = w.actor.execute_rank_split("compute_log_probs", per_rank)
        full: list[list[float]] = [[] for _ in sequences]
        used: list[torch.Tensor | None] = [None] * len(sequences)
        for rank, result in enumerate(results):
            if w.reports[rank]:
                for k, i in enumerate(shares[w.dp_rank[rank]]):
                    full[i] = result["log_probs"][k]
                    if record_routes:
                        used[i] = result["routes"][k]
        out: dict[str, list] = {
            "log_probs": [batch.response_slice(full[i], i) for i in range(len(full))]}
        if record_routes:
            out["routes"] = used
        return out

    def compute_old_log_probs(self, batch: StepBatch) -> dict[str, float]:
        """Old log-probs and the routes the update replays (R2: recorded in this forward; R3:
        the engine's, replayed in it), the engine/trainer log-prob and routing gaps, and
        rollout correction. In bypass mode the engine's log-probs are the old ones."""
        mode = self.cfg.actor.router_replay.mode
        engine = batch.engine_routes() if self.cfg.rollout.enable_return_routed_experts else None
        if self.cfg.algorithm.rollout_correction.bypass_mode:
            if any(s.log_probs is None for s in batch.samples):
                raise ValueError("algorithm.rollout_correction.bypass_mode: a sample came back "
                                 "without the engine's log-probs, which bypass mode trains on")
            batch.old_log_probs = [list(s.log_probs) for s in batch.samples]
            batch.loss_mask, batch.rollout_is_weights = batch.response_mask(), None
            batch.replay_routes = engine if mode == "R3" else None
            return {}
        metrics: dict[str, float] = {}
        if mode == "R3":
            if self.cfg.actor.router_replay.diagnose_no_replay:
                own = self.compute_log_probs(batch, record_routes=True)
                metrics.update(self._mismatch_metrics(batch, own, engine, suffix="_no_replay"))
            used = self.compute_log_probs(batch, routes=engine, record_routes=True)
        else:
            used = self.compute_log_probs(batch, record_routes=engine is not None
                                          or mode == "R2")
        metrics.update(self._mismatch_metrics(batch, used, engine))
        batch.old_log_probs = used["log_probs"]
        batch.replay_routes = used["routes"] if mode != "disabled" else None
        metrics.update(self._rollout_correction(batch))
        return metrics

    def _mismatch_metrics(self, batch: StepBatch, forward: dict[str, list],
                          engine: list[torch.Tensor] | None, suffix: str = "") -> dict[str, float]:
        """``training/rollout_probs_diff{suffix}_*`` and ``rollout/moe/router_agreement{suffix}``
        of one trainer forward against the engine's log-probs and routes."""
        diff = rollout_probs_diff_metrics(batch.padded(forward["log_probs"]),
                                          batch.rollout_log_probs(), batch.response_mask())
        metrics = {f"training/{k.replace('diff_', f'diff{suffix}_')}": float(v)
                   for k, v in diff.items()}
        if engine is not None:
            metrics[f"rollout/moe/router_agreement{suffix}"] = float(
                router_agreement(engine, forward["routes"]))
        return metrics

    def _rollout_correction(self, batch: StepBatch) -> dict[str, float]:
        """IS weights and the rejection mask between old and rollout log-probs; their
        ``rollout_corr/*`` metrics."""
        rc = self.cfg.algorithm.rollout_correction
        is_lower, is_upper = rc.is_bounds()
        weights, batch.loss_mask, corr = compute_rollout_correction(
            batch.padded(batch.old_log_probs), batch.rollout_log_probs(), batch.response_mask(),
            rollout_is=rc.rollout_is, rollout_is_threshold=is_upper,
            rollout_is_threshold_lower=is_lower,
            rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
            rollout_rs=rc.rs_criteria() or None, rollout_rs_threshold=rc.rs_bounds())
        batch.rollout_is_weights = weights
        return {f"rollout_corr/{k}": float(v) for k, v in corr.items()
                if not k.startswith("rollout_probs_diff")}

    def update_actor(self, batch: StepBatch) -> dict[str, float]:
        """``ppo_epochs`` passes of mini-batch updates; each mini-batch is split over DP."""
        w, cfg = self.workers, self.cfg
        per_mini = cfg.actor.ppo_mini_batch_size * batch.n
        minis = [list(range(s, min(s + per_mini, len(batch)))) for s in range(0, len(batch),
                                                                              per_mini)]
        records = [batch.train_record(i) for i in range(len(batch))]
        per_dp: list[list[list[dict]]] = [[] for _ in range(w.dp_size)]
        for _ in range(cfg.actor.ppo_epochs):
            for mini in minis:
                for d, share in enumerate(even_shares(len(mini), w.dp_size)):
                    per_dp[d].append([records[mini[j]] for j in share])
        per_rank = [(per_dp[w.dp_rank[r]],) for r in range(w.actor.world_size)]
        results = w.actor.execute_rank_split("update", per_rank)
        skipped = [m.get("actor/update_skipped", 0.0) for m in results[0]]
        for line in self.nonfinite.observe(skipped, self.steps_done + 1, batch.prompts):
            self.warn(line)
        return reduce_metrics(results[0])

    def batch_metrics(self, batch: StepBatch, metrics: dict[str, float]) -> dict[str, float]:
        """Response lengths, score and advantage statistics, throughput."""
        lengths = torch.tensor([len(s.response_ids) for s in batch.samples], dtype=torch.float32)
        max_len = self.cfg.data.max_response_length
        out = {
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/min": float(lengths.min()),
            "response_length/clip_ratio": float((lengths >= max_len).float().mean()),
            "response/aborted_ratio": float(sum(s.finish_reason == "abort"
                                                for s in batch.samples) / len(batch)),
            "critic/advantages/mean": float(batch.advantages[batch.response_mask() > 0].mean()),
        }
        out.update(agent_metrics(batch.samples))
        prompt_tokens = sum(len(s.prompt_ids) for s in batch.samples)
        out.update(throughput_metrics(
            metrics, prompt_tokens=prompt_tokens, response_tokens=int(lengths.sum()),
            num_train_gpus=self.workers.actor.world_size,
            num_rollout_gpus=self.workers.num_rollout_gpus, ppo_epochs=self.cfg.actor.ppo_epochs))
        return out
