"""The RL trainer: ``megarl train --config CONFIG [a.b.c=value ...]``.

One step (``colocate_sync``), read top to bottom in :meth:`Trainer.step`:

1. take ``data.train_batch_size`` prompts;
2. generate ``rollout.n`` responses per prompt on the rollout engines (token ids, the engine's
   log-probs, the ``weight_version`` of every sample);
3. score them (batched reward manager);
4. recompute old log-probs on the actor (and reference log-probs when a KL term needs them);
   compare with the engine's log-probs; rollout correction when configured;
5. compute advantages on the driver (``megarl.algo``) from token-level rewards: the score on
   the last response token, minus beta x KL(old || ref) per token with
   ``algorithm.use_kl_in_reward``;
6. update the actor: ``ppo_epochs`` x mini-batches, each split over the data-parallel ranks;
7. stream the new weights to every engine; ``weight_version += 1``;
8. log metrics, run the health monitor.

Colocated (``rollout.colocate``), memory changes hands around steps 3-7: the engines release
their KV cache and weights; the actor trains, offloads its gradients and optimizer state
(``actor.offload.*``, on by default when colocated) and hands its allocator cache back to the
driver; the engines resume their weights; the sync writes into them (then the actor's
parameters are offloaded when ``param_offload`` is on) and the actor hands back its cache again,
the sync's buckets included; the engines resume their KV cache.

Steps 2 (:meth:`Trainer.rollout`), 3-6 (:meth:`Trainer.train_on`) and 7
(:meth:`Trainer.sync_weights`) are written once; ``scheduler.mode`` picks a scheduler
(:mod:`megarl.scheduler`) that only decides what overlaps with what: ``one_step_off`` trains
step k while the engines generate step k+1, ``fully_async`` feeds training from a queue that
the engines fill continuously.

Workers: one :class:`~megarl.megatron.worker.ActorWorker` per train-pool slot and one
:class:`~megarl.rollout.server_worker.RolloutServerWorker` per engine, in Ray placement groups.

Files, one role each: :mod:`~megarl.trainer.step` (the step and the run loop),
:mod:`~megarl.trainer.phases` (the phases it calls), :mod:`~megarl.trainer.base` (state, setup,
outputs, the driver), :mod:`~megarl.trainer.workers` (pools, workers, engines, the weight sync),
:mod:`~megarl.trainer.critic` (the critic's part of the step), :mod:`~megarl.trainer.checkpoint`
(save and resume, on the state they hold, not the trainer), :mod:`~megarl.trainer.main` (the
``megarl train`` command).
"""

from megarl.trainer.base import make_agent_loop
from megarl.trainer.main import load_run_config, preflight_refuses, startup_text, train_main
from megarl.trainer.step import Trainer

__all__ = ["Trainer", "load_run_config", "make_agent_loop", "preflight_refuses", "startup_text",
           "train_main"]
