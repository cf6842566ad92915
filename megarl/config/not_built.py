"""Settings whose machinery is not part of this trainer yet: refused, never ignored.

One entry per setting: (field, whether ``cfg`` uses the unbuilt machinery, why and the fix).
``megarl config validate`` and ``megarl train`` both report every entry that applies as an
error (validate.py's ``check_not_built``); once the machinery exists its entry is deleted.
"""

from __future__ import annotations

from collections.abc import Callable

from megarl.config.schema import RunConfig

NotBuilt = tuple[str, Callable[[RunConfig], bool], str]

NOT_BUILT: tuple[NotBuilt, ...] = (
    ("checkpoint_engine.backend", lambda c: c.checkpoint_engine.backend in ("nixl", "disk"),
     ("the trainer streams weights over SGLang's protocols: update_weights_from_tensor (ipc, "
      "colocated) or update_weights_from_distributed (nccl; gloo on CPU); the nixl and disk "
      "transports run in `megarl bench weight-sync` only so far; set "
      "checkpoint_engine.backend=auto")),
    ("algorithm.filter_groups.metric",
     lambda c: c.algorithm.filter_groups.metric in ("acc", "seq_final_reward"),
     ("dynamic sampling filters on the reward score (= seq_reward, the sum of the token-level "
      "scores); the reward function's extra values such as acc are not kept, and the KL-"
      "penalised seq_final_reward exists only after the filter; set "
      "algorithm.filter_groups.metric=score")),
    ("algorithm.rollout_correction.bypass_mode",
     lambda c: c.algorithm.rollout_correction.bypass_mode and (
         c.algorithm.rollout_correction.rollout_is or c.algorithm.rollout_correction.rollout_rs),
     ("bypass_mode makes the rollout log-probs the PPO anchor; IS weights / rejection against "
      "the current policy inside the loss are not built; set algorithm.rollout_correction."
      "rollout_is=null and rollout_rs=null, or bypass_mode=false")),
    ("algorithm.kl_penalty", lambda c: c.algorithm.use_kl_in_reward
     and c.algorithm.kl_penalty == "full",
     ("the full-distribution KL needs the logits, which the trainer does not keep; use kl, abs, "
      "mse or low_var_kl")),
    ("actor.router_replay.mode", lambda c: c.actor.router_replay.mode == "R2"
     and c.algorithm.rollout_correction.bypass_mode,
     ("R2 records routes in the old-log-prob forward, which bypass_mode skips; use "
      "actor.router_replay.mode=R3 or algorithm.rollout_correction.bypass_mode=false")),
)
