"""Cross-field validation of a run config: one named rule per check, every problem collected and
reported at once as ``field(s): what is wrong — fix``, errors apart from warnings.

Covers PITFALLS S3 (files readable before any worker starts), B2 (batch sizes that divide),
T7 (param + optimizer offload) and the consistency of pools, schedulers and algorithm options
here; B3-B5 (layout against the model's architecture) live in validate_layout.py, T1 (memory
per GPU) in estimates.py.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from megarl.config.derived import (
    derive_sizes,
    divisors,
    is_whole,
    nearest_divisor,
    nearest_multiple,
)
from megarl.config.estimates import check_memory_fits
from megarl.config.model_info import ModelInfo, ModelInfoError, load_model_info, weight_files
from megarl.config.not_built import NOT_BUILT
from megarl.config.problems import Context, Problem, error, warning
from megarl.config.schema import RunConfig
from megarl.config.schema_common import is_loopback_host
from megarl.config.validate_layout import LAYOUT_RULES, Rule

# ---------------------------------------------------------------------------------------------
# Batch sizes (B2)


def check_mini_batch_divides_train_batch(ctx: Context) -> Iterator[Problem]:
    """train_batch_size >= ppo_mini_batch_size, and a whole number of mini-batches per step."""
    train, mini = ctx.cfg.data.train_batch_size, ctx.cfg.actor.ppo_mini_batch_size
    fields = ("data.train_batch_size", "actor.ppo_mini_batch_size")
    if mini > train:
        yield error(fields, f"ppo_mini_batch_size {mini} is larger than train_batch_size {train}",
                    f"set actor.ppo_mini_batch_size={nearest_divisor(train, mini)} or "
                    f"data.train_batch_size={mini}")
    elif train % mini:
        yield error(fields, f"train_batch_size {train} is not a multiple of ppo_mini_batch_size "
                    f"{mini}", f"set actor.ppo_mini_batch_size={nearest_divisor(train, mini)} or "
                    f"data.train_batch_size={nearest_multiple(mini, train)}")


def check_micro_batch_sizes_exclusive(ctx: Context) -> Iterator[Problem]:
    """Exactly one of the global and per-GPU micro-batch sizes (unless dynamic batch size)."""
    actor, dp = ctx.cfg.actor, ctx.sizes.actor.dp
    if actor.ppo_micro_batch_size is not None and actor.ppo_micro_batch_size_per_gpu is not None:
        yield error(("actor.ppo_micro_batch_size", "actor.ppo_micro_batch_size_per_gpu"),
                    "both the global and the per-GPU micro-batch size are set",
                    f"remove actor.ppo_micro_batch_size and keep "
                    f"actor.ppo_micro_batch_size_per_gpu={actor.ppo_micro_batch_size_per_gpu}")
    elif (actor.ppo_micro_batch_size is None and actor.ppo_micro_batch_size_per_gpu is None
          and not actor.use_dynamic_bsz):
        per_rank = ctx.sizes.sequences_per_mini_batch_per_dp_rank
        size = nearest_divisor(per_rank, 4) if is_whole(per_rank) else 1
        yield error("actor.ppo_micro_batch_size_per_gpu", "no micro-batch size is set",
                    f"set actor.ppo_micro_batch_size_per_gpu={size} (a divisor of the "
                    f"{per_rank if is_whole(per_rank) else 'n/a'} sequences a DP rank gets per "
                    f"mini-batch, dp={dp}) or actor.use_dynamic_bsz=true")


def check_global_micro_batch_splits_over_dp(ctx: Context) -> Iterator[Problem]:
    """The deprecated global micro-batch must split evenly over the DP ranks."""
    actor, dp = ctx.cfg.actor, ctx.sizes.actor.dp
    micro = actor.ppo_micro_batch_size
    if (micro is None or actor.ppo_micro_batch_size_per_gpu is not None or actor.use_dynamic_bsz
            or not is_whole(dp) or micro % dp == 0):
        return
    yield error("actor.ppo_micro_batch_size", f"the global micro-batch of {micro} sequences does "
                f"not split over dp={dp} ranks", f"set actor.ppo_micro_batch_size="
                f"{nearest_multiple(dp, micro)} or use actor.ppo_micro_batch_size_per_gpu")


def _mini_options(train: int, n: int, dp: int) -> list[int]:
    """Mini-batch sizes (prompts) that divide train and give whole sequences per DP rank."""
    return [m for m in divisors(train) if (m * n) % dp == 0]


def check_mini_batch_splits_over_dp(ctx: Context) -> Iterator[Problem]:
    """(ppo_mini_batch_size x n) sequences must split evenly over the actor's DP ranks."""
    cfg, dp = ctx.cfg, ctx.sizes.actor.dp
    mini, n = cfg.actor.ppo_mini_batch_size, cfg.rollout.n
    if not is_whole(dp) or (mini * n) % dp == 0:
        return
    options = _mini_options(cfg.data.train_batch_size, n, dp)
    train = cfg.data.train_batch_size
    fix = (f"set actor.ppo_mini_batch_size={min(options, key=lambda m: (abs(m - mini), m))}"
           if options else f"set data.train_batch_size={nearest_multiple(dp, train)} and "
           f"actor.ppo_mini_batch_size={nearest_multiple(dp, mini)}")
    yield error(("actor.ppo_mini_batch_size", "rollout.n"), f"a mini-batch of {mini} prompts x "
                f"{n} samples = {mini * n} sequences does not split over dp={dp} ranks", fix)


def check_micro_batch_divides_mini_batch(ctx: Context) -> Iterator[Problem]:
    """The sequences a DP rank gets per mini-batch must be a multiple of its micro-batch."""
    s = ctx.sizes
    per_rank, micro = s.sequences_per_mini_batch_per_dp_rank, s.micro_batch_size_per_gpu
    if not is_whole(per_rank) or not is_whole(micro) or per_rank % micro == 0:
        return
    actor = ctx.cfg.actor
    field = ("actor.ppo_micro_batch_size_per_gpu" if actor.ppo_micro_batch_size_per_gpu
             else "actor.ppo_micro_batch_size")
    yield error((field, "actor.ppo_mini_batch_size", "rollout.n"),
                f"each DP rank gets {per_rank} sequences per mini-batch (ppo_mini_batch_size "
                f"{actor.ppo_mini_batch_size} x n {ctx.cfg.rollout.n} / dp {s.actor.dp}), not a "
                f"multiple of the micro-batch of {micro}",
                f"set actor.ppo_micro_batch_size_per_gpu={nearest_divisor(per_rank, micro)}")


def check_dynamic_bsz_token_budget(ctx: Context) -> Iterator[Problem]:
    """A dynamic micro-batch must hold at least one sequence of the longest length."""
    actor, data = ctx.cfg.actor, ctx.cfg.data
    cp = actor.parallel.cp
    longest = data.max_prompt_length + data.max_response_length
    if actor.use_dynamic_bsz and actor.ppo_max_token_len_per_gpu * cp < longest:
        yield error(("actor.ppo_max_token_len_per_gpu", "data.max_prompt_length",
                     "data.max_response_length"),
                    f"the token budget {actor.ppo_max_token_len_per_gpu} x cp {cp} is smaller "
                    f"than one sequence of {data.max_prompt_length} + "
                    f"{data.max_response_length} = {longest} tokens",
                    f"set actor.ppo_max_token_len_per_gpu={math.ceil(longest / cp)} or more")


def check_critic_batch_split(ctx: Context) -> Iterator[Problem]:
    """The critic's mini/micro batches must split like the actor's."""
    cfg = ctx.cfg
    critic = cfg.critic
    if not critic.enabled or critic.ppo_mini_batch_size is None:
        return
    train, mini, n = cfg.data.train_batch_size, critic.ppo_mini_batch_size, cfg.rollout.n
    if train % mini:
        yield error(("critic.ppo_mini_batch_size", "data.train_batch_size"), f"train_batch_size "
                    f"{train} is not a multiple of the critic's mini-batch {mini}",
                    f"set critic.ppo_mini_batch_size={nearest_divisor(train, mini)}")
        return
    dp = ctx.sizes.critic.dp if ctx.sizes.critic else ctx.sizes.actor.dp
    micro = critic.ppo_micro_batch_size_per_gpu
    if not is_whole(dp) or micro is None or cfg.actor.use_dynamic_bsz:
        return
    per_rank = mini * n / dp
    if per_rank != int(per_rank) or int(per_rank) % micro:
        fix = (f"set critic.ppo_micro_batch_size_per_gpu={nearest_divisor(int(per_rank), micro)}"
               if per_rank == int(per_rank) else "choose a critic.ppo_mini_batch_size whose "
               f"sequences split over dp={dp}")
        yield error(("critic.ppo_mini_batch_size", "critic.ppo_micro_batch_size_per_gpu"),
                    f"the critic's {mini * n} sequences per mini-batch over dp={dp} do not split "
                    f"into micro-batches of {micro}", fix)


# ---------------------------------------------------------------------------------------------
# Files (S3) and the model directory


def check_model_dir(ctx: Context) -> Iterator[Problem]:
    """model.path must be an HF model directory whose config.json can be read."""
    if ctx.model_error is None:
        return
    if not Path(ctx.cfg.model.path).exists():
        yield ctx.missing("model.path", f"{ctx.model_error}; the checks against the model's "
                          "architecture were skipped", "create it first (megarl demo builds the "
                          "tiny one) or point model.path at an HF model directory")
    else:
        yield error("model.path", ctx.model_error, "point model.path at an HF model directory "
                    "(config.json + safetensors)")


def check_model_weights(ctx: Context) -> Iterator[Problem]:
    """A model card (config.json without weights) passes the config checks, not a training run.

    The architecture checks and estimates read config.json only; loading the model needs the
    checkpoint, so a card is reported like a missing file.
    """
    path = Path(ctx.cfg.model.path)
    if (path / "config.json").is_file() and not weight_files(path):
        yield ctx.missing("model.path", f"{path} has a config.json but no weights (*.safetensors):"
                          " a model card — the architecture checks and estimates ran, but training"
                          " and serving need the checkpoint", "point model.path at the HF "
                          "checkpoint directory of this model")


def _path_problem(ctx: Context, field: str, path: str) -> Problem | None:
    """A problem when ``path`` does not exist or cannot be read."""
    p = Path(path)
    if not p.exists():
        return ctx.missing(field, f"{path} does not exist", "check the path, or create the file "
                           "before starting (every node must be able to read it)")
    if not os.access(p, os.R_OK) or (p.is_dir() and not os.access(p, os.X_OK)):
        return error(field, f"{path} is not readable by this user", "fix its permissions")
    return None


def check_data_files(ctx: Context) -> Iterator[Problem]:
    """Every data file exists and is readable before any worker starts (S3)."""
    data = ctx.cfg.data
    for field, files in (("data.train_files", data.train_files),
                         ("data.val_files", data.val_files)):
        for path in files:
            problem = _path_problem(ctx, field, path)
            if problem is not None:
                yield problem


def check_other_paths(ctx: Context) -> Iterator[Problem]:
    """Tokenizer, dist checkpoint, critic start point and resume directory exist when given
    explicitly."""
    cfg = ctx.cfg
    candidates = [("model.tokenizer_path", cfg.model.tokenizer_path),
                  ("model.mcore_checkpoint", cfg.model.mcore_checkpoint)]
    if cfg.critic.enabled:
        candidates.append(("critic.model_path", cfg.critic.model_path))
    if cfg.trainer.resume not in ("auto", "never"):
        candidates.append(("trainer.resume", cfg.trainer.resume))
    for field, path in candidates:
        if path and path != cfg.model.path:
            problem = _path_problem(ctx, field, path)
            if problem is not None:
                yield problem


# ---------------------------------------------------------------------------------------------
# Pools, schedulers, transports


def check_pools_and_colocation(ctx: Context) -> Iterator[Problem]:
    """Colocated engines use the train pool; separate pools need a rollout_pool."""
    rollout, resources = ctx.cfg.rollout, ctx.cfg.resources
    if rollout.colocate and resources.rollout_pool is not None:
        yield error(("rollout.colocate", "resources.rollout_pool"), "colocated engines run on the "
                    "train pool, so resources.rollout_pool would be ignored",
                    "set rollout.colocate=false to use the separate pool, or remove "
                    "resources.rollout_pool")
    if not rollout.colocate and resources.rollout_pool is None:
        yield error(("rollout.colocate", "resources.rollout_pool"), "separate engines need a "
                    "rollout pool", "add resources.rollout_pool (nnodes, gpus_per_node) or set "
                    "rollout.colocate=true")


def check_scheduler_needs_separate_pools(ctx: Context) -> Iterator[Problem]:
    """one_step_off and fully_async overlap rollout with training, so they need two pools and
    Ray; fully_async's queue must hold at least one step."""
    cfg = ctx.cfg
    mode, sched = cfg.scheduler.mode, cfg.scheduler
    if mode != "colocate_sync" and cfg.rollout.colocate:
        yield error(("scheduler.mode", "rollout.colocate"), f"{mode} overlaps generation with "
                    "training, which needs engines on their own GPUs: a colocated engine gives "
                    "its weights and KV cache back while the actor trains, so it cannot generate "
                    "then (on one GPU, colocate_sync is the only schedule; the pools cannot share "
                    "a GPU)", "set rollout.colocate=false with a resources.rollout_pool on other "
                    "GPUs, or scheduler.mode=colocate_sync")
    if mode != "colocate_sync" and cfg.trainer.worker_group == "naive":
        yield error(("scheduler.mode", "trainer.worker_group"), f"{mode} generates on a "
                    "background thread next to Ray workers; the no-Ray mode runs colocate_sync "
                    "only", "set trainer.worker_group=ray or scheduler.mode=colocate_sync")
    step = cfg.data.train_batch_size * cfg.rollout.n
    if mode == "fully_async" and sched.max_queue_length is not None and (
            sched.max_queue_length < step):
        yield error(("scheduler.max_queue_length", "data.train_batch_size", "rollout.n"),
                    f"the queue holds {sched.max_queue_length} samples but a step consumes "
                    f"{step}, so the trainer would wait forever",
                    f"set scheduler.max_queue_length >= {step}, or null")


def check_weight_sync_backend(ctx: Context) -> Iterator[Problem]:
    """ipc needs colocation; nccl cannot serve colocated engines on GPUs; nixl needs the NIXL
    package."""
    backend = ctx.cfg.checkpoint_engine.backend
    if backend == "nccl" and ctx.cfg.rollout.colocate and ctx.cfg.resources.device != "cpu":
        yield error(("checkpoint_engine.backend", "rollout.colocate"), "a colocated engine shares "
                    "its GPU with a train rank, and NCCL refuses two ranks of one group on one "
                    "GPU ('Duplicate GPU detected')",
                    "use checkpoint_engine.backend=ipc (or auto), which hands the engine CUDA "
                    "IPC handles")
    if backend == "ipc" and not ctx.cfg.rollout.colocate:
        yield error(("checkpoint_engine.backend", "rollout.colocate"), "ipc moves weights inside "
                    "one machine's shared memory, but the engines are on a separate pool",
                    "use checkpoint_engine.backend=nccl (or auto)")
    if backend == "nixl" and not any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12")):
        yield error("checkpoint_engine.backend", "the NIXL package is not installed",
                    "pip install nixl-cu12, or use checkpoint_engine.backend=nccl")


def check_rollout_bind_needs_api_key(ctx: Context) -> Iterator[Problem]:
    """Engines reachable beyond this machine must require an API key: their weight-update
    endpoints replace the model (and ``update_weights_from_tensor`` unpickles its input)."""
    rollout = ctx.cfg.rollout
    if not is_loopback_host(rollout.host) and not rollout.api_key:
        yield error(("rollout.host", "rollout.api_key"),
                    f"host {rollout.host} opens the engines' generation, control and "
                    "weight-update endpoints to the network without an API key",
                    "set rollout.api_key (e.g. from a secret: rollout.api_key=$KEY) or "
                    "rollout.host=127.0.0.1")


def check_device_settings(ctx: Context) -> Iterator[Problem]:
    """SGLang needs CUDA; CPU runs are meant for fp32."""
    cfg = ctx.cfg
    if cfg.resources.device != "cpu":
        return
    if cfg.rollout.backend == "sglang":
        yield error(("rollout.backend", "resources.device"), "SGLang engines need CUDA GPUs",
                    "set rollout.backend=local on CPU")
    if cfg.model.dtype != "float32":
        yield warning(("model.dtype", "resources.device"), f"{cfg.model.dtype} on CPU is slow and "
                      "some CPU kernels need aligned strides", "set model.dtype=float32 on CPU")
    processes = cfg.resources.train_pool.world_size + (0 if cfg.rollout.colocate else (
        cfg.resources.rollout_pool.world_size if cfg.resources.rollout_pool else 0))
    if cfg.ray.num_cpus is not None and cfg.ray.num_cpus < processes:
        yield warning(("ray.num_cpus", "resources"), f"{processes} worker processes but Ray may "
                      f"use {cfg.ray.num_cpus} CPUs; workers wait for a free CPU",
                      f"set ray.num_cpus={processes} or more")


# ---------------------------------------------------------------------------------------------
# Algorithm


def check_offload_param_and_optimizer(ctx: Context) -> Iterator[Problem]:
    """Param + optimizer offload together is slower and uses more memory than either (T7)."""
    for role, offload in (("actor", ctx.cfg.actor.offload), ("critic", ctx.cfg.critic.offload)):
        if offload.param_offload and offload.optimizer_offload and (
                role == "actor" or ctx.cfg.critic.enabled):
            field = f"{role}.offload.optimizer_offload"
            derived = ctx.sources.get(field) == "derived"
            why = " (optimizer offload is on by default with rollout.colocate=true)" if (
                derived) else ""
            fix = (f"keep one: drop {role}.offload.param_offload, or set {field}=false; "
                   if derived else "keep one: ")
            yield warning((f"{role}.offload.param_offload", field),
                          "param and optimizer offload together are slower and need more memory "
                          f"than either alone{why}", f"{fix}{field}=true alone usually frees the "
                          "most GPU memory")


def check_not_built(ctx: Context) -> Iterator[Problem]:
    """Settings whose machinery the trainer does not have yet (not_built.py's list)."""
    for field, applies, fix in NOT_BUILT:
        if applies(ctx.cfg):
            yield error(field, "not built in this version of megarl", fix)


GROUP_ESTIMATORS = ("grpo", "grpo_passk", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline")


def check_group_size(ctx: Context) -> Iterator[Problem]:
    """Group-relative estimators and dynamic sampling need several responses per prompt."""
    cfg = ctx.cfg
    n, estimator = cfg.rollout.n, cfg.algorithm.adv_estimator
    if n < 2 and estimator in GROUP_ESTIMATORS:
        yield error(("rollout.n", "algorithm.adv_estimator"), f"{estimator} compares responses "
                    "to the same prompt but rollout.n=1 gives every advantage 0",
                    "set rollout.n=8 (or any n >= 2)")
    elif n < 2 and cfg.algorithm.filter_groups.enable:
        yield error(("rollout.n", "algorithm.filter_groups.enable"), "dynamic sampling drops "
                    "groups without reward variance; a group of 1 never has any",
                    "set rollout.n >= 2")


def check_estimator_is_built(ctx: Context) -> Iterator[Problem]:
    """ReMax's baseline is the reward of a greedy response per prompt, which is not generated."""
    if ctx.cfg.algorithm.adv_estimator == "remax":
        yield error("algorithm.adv_estimator", "remax needs a greedy (temperature 0) baseline "
                    "rollout per prompt and its reward; the trainer does not generate one yet",
                    "use algorithm.adv_estimator=grpo, rloo or opo")


def check_critic_for_gae(ctx: Context) -> Iterator[Problem]:
    """gae needs the critic; a critic without gae is trained for nothing."""
    cfg = ctx.cfg
    if cfg.algorithm.adv_estimator == "gae" and not cfg.critic.enabled:
        yield error(("algorithm.adv_estimator", "critic.enabled"), "gae needs a value model but "
                    "the critic is off", "set critic.enabled=true (or leave it unset)")
    elif cfg.algorithm.adv_estimator != "gae" and cfg.critic.enabled:
        yield warning(("critic.enabled", "algorithm.adv_estimator"), f"the critic is trained but "
                      f"{cfg.algorithm.adv_estimator} does not use it",
                      "leave critic.enabled unset")


def check_reference_layout(ctx: Context) -> Iterator[Problem]:
    """The reference model is built inside the actor's workers, with the actor's layout."""
    ref, actor = ctx.cfg.ref.parallel, ctx.cfg.actor.parallel
    if ref is None:
        return
    for name, value in ref.model_dump().items():
        if value != getattr(actor, name):
            yield error(f"ref.parallel.{name}", f"{value} differs from actor.parallel.{name}="
                        f"{getattr(actor, name)}, but the reference model shares the actor's "
                        "workers and layout", "remove ref.parallel or set it equal to "
                        "actor.parallel")


def check_reference_for_kl(ctx: Context) -> Iterator[Problem]:
    """KL terms need the reference model; KL in both loss and reward is counted twice."""
    cfg = ctx.cfg
    kl_loss, kl_reward = cfg.actor.use_kl_loss, cfg.algorithm.use_kl_in_reward
    if (kl_loss or kl_reward) and not cfg.ref.enabled:
        field = "actor.use_kl_loss" if kl_loss else "algorithm.use_kl_in_reward"
        yield error((field, "ref.enabled"), "a KL term needs the reference model but it is off",
                    "set ref.enabled=true (or leave it unset)")
    if kl_loss and kl_reward:
        yield warning(("actor.use_kl_loss", "algorithm.use_kl_in_reward"), "KL is applied both in "
                      "the loss and in the reward",
                      "keep one (GRPO usually uses actor.use_kl_loss)")


def check_policy_loss_settings(ctx: Context) -> Iterator[Problem]:
    """GSPO and GMPO are sequence-level objectives: sequence-mean aggregation, small GSPO clips."""
    actor = ctx.cfg.actor
    mode = actor.policy_loss.loss_mode
    if mode in ("gspo", "geo_mean") and actor.loss_agg_mode != "seq-mean-token-mean":
        paper = "GSPO" if mode == "gspo" else "GMPO"
        yield error(("actor.policy_loss.loss_mode", "actor.loss_agg_mode"), f"{paper} "
                    f"(loss_mode={mode}) is a sequence-level objective: a mean over sequences of "
                    f"one loss per sequence; loss_agg_mode={actor.loss_agg_mode} would train "
                    "another objective", "set actor.loss_agg_mode=seq-mean-token-mean")
    if mode == "gspo" and max(actor.clip_ratio_low, actor.clip_ratio_high) > 0.01:
        yield warning(("actor.clip_ratio_low", "actor.clip_ratio_high"), "GSPO's sequence ratios "
                      "are geometric means near 1; clip ratios this large never clip",
                      "use clip_ratio_low=3e-4 and clip_ratio_high=4e-4 (GSPO paper)")
    if mode == "clip_cov" and actor.policy_loss.clip_cov_lb >= actor.policy_loss.clip_cov_ub:
        yield error(("actor.policy_loss.clip_cov_lb", "actor.policy_loss.clip_cov_ub"),
                    "the covariance band is empty", "set clip_cov_lb < clip_cov_ub "
                    "(the paper: 1 and 5)")


def check_rollout_correction(ctx: Context) -> Iterator[Problem]:
    """Rejection sampling needs a threshold per criterion; truncation below 1 shrinks every
    weight; a k1 bound that reads as verl's (on -log ratio) is flagged."""
    rc = ctx.cfg.algorithm.rollout_correction
    prefix = "algorithm.rollout_correction."
    is_lower, is_upper = rc.is_bounds()
    if rc.rollout_is is not None and is_lower is None and is_upper <= 1:
        yield warning(prefix + "rollout_is_threshold", f"a truncation at {is_upper} "
                      "<= 1 down-weights on-policy tokens too",
                      f"use {prefix}rollout_is_threshold=2.0")
    criteria = rc.rs_criteria()
    if criteria and rc.rollout_rs_threshold is None:
        example = "2.0" if criteria[0].endswith("k1") else "0.01"
        yield error((prefix + "rollout_rs", prefix + "rollout_rs_threshold"), f"rejection "
                    f"sampling {rc.rollout_rs} has no threshold",
                    f"set {prefix}rollout_rs_threshold (e.g. {example})")
        return
    bounds = rc.rs_bounds()
    if len(bounds) != len(criteria):
        yield error((prefix + "rollout_rs_threshold", prefix + "rollout_rs"), f"{len(bounds)} "
                    f"thresholds for {len(criteria)} criteria ({rc.rollout_rs})",
                    "give one threshold for all criteria or one per criterion, comma-separated")
        return
    for criterion, (lower, upper) in zip(criteria, bounds):
        yield from _check_rs_bounds(criterion, lower, upper, prefix)


def _check_rs_bounds(criterion: str, lower: float | None, upper: float,
                     prefix: str) -> Iterator[Problem]:
    """One criterion's bounds: ratio bounds around 1 for k1, a positive upper for k2/k3."""
    field = prefix + "rollout_rs_threshold"
    if not criterion.endswith("k1"):
        if lower is not None or upper <= 0:
            given = upper if lower is None else f"{lower}_{upper}"
            yield error(field, f"{criterion} bounds a divergence: it takes one upper bound > 0, "
                        f"got {given}", f"give {criterion} a single upper bound such as 0.01")
        return
    low = lower if lower is not None else (1 / upper if upper > 0 else 0.0)
    band = f"{lower}_{upper}" if lower is not None else f"{upper} (lower 1/{upper})"
    verl_fix = (f"megarl bounds the ratio pi_old / mu; verl's k1 'a_b' bounds -log ratio and "
                f"is megarl's 'exp(-b)_exp(-a)': use {field}='{math.exp(-upper):.3g}_"
                f"{math.exp(-low):.3g}'" if lower is not None else
                f"megarl bounds the ratio pi_old / mu (verl bounds -log ratio); use e.g. "
                f"{field}=2.0")
    if upper <= 0 or low < 0:
        yield error(field, f"{criterion}: {band} are not ratio bounds (a ratio is > 0)",
                    verl_fix)
    elif low > upper:
        yield error((prefix + "rollout_rs_threshold_lower", field), f"{criterion}: the ratio "
                    f"band {band} is empty", verl_fix)
    elif low > 1 or upper < 1:
        yield warning(field, f"{criterion}: the ratio band {band} rejects the on-policy ratio "
                      "1; this looks like verl's convention", verl_fix)


def check_router_replay(ctx: Context) -> Iterator[Problem]:
    """Router replay needs a MoE model; R3 needs the engines to return their routes."""
    cfg, model = ctx.cfg, ctx.model
    mode = cfg.actor.router_replay.mode
    if mode != "disabled" and model is not None and not model.is_moe:
        yield error("actor.router_replay.mode", f"router replay {mode} needs a MoE model, but "
                    f"{model.model_type} has no routed experts",
                    "set actor.router_replay.mode=disabled")
    if mode == "R3" and not cfg.rollout.enable_return_routed_experts:
        yield error(("actor.router_replay.mode", "rollout.enable_return_routed_experts"),
                    "R3 replays the routes returned by the engines, which are told not to return "
                    "them", "set rollout.enable_return_routed_experts=true (or leave it unset)")
    if cfg.rollout.enable_return_routed_experts and model is not None and not model.is_moe:
        yield warning("rollout.enable_return_routed_experts", "the model has no routed experts "
                      "to return", "set rollout.enable_return_routed_experts=false")


def check_cuda_graphs(ctx: Context) -> Iterator[Problem]:
    """CUDA-graphed updates need a GPU, one pipeline stage, no router replay, no activation
    recompute and parameters that stay at their addresses (no param offload)."""
    cfg = ctx.cfg
    actor = cfg.actor
    if not actor.cuda_graphs:
        return
    if actor.parallel.pp > 1:
        yield error(("actor.cuda_graphs", "actor.parallel.pp"), "CUDA graphs replay one "
                    "micro-batch at a time; the pipeline schedule keeps several in flight",
                    "set actor.cuda_graphs=false or actor.parallel.pp=1")
    replay = actor.router_replay.mode != "disabled" or cfg.rollout.enable_return_routed_experts
    if replay:
        yield error(("actor.cuda_graphs", "actor.router_replay.mode"), "router replay sets the "
                    "routes of each micro-batch outside the graph", "set actor.cuda_graphs=false "
                    "(or actor.router_replay.mode=disabled and "
                    "rollout.enable_return_routed_experts=false)")
    if actor.recompute.granularity != "none":
        yield error(("actor.cuda_graphs", "actor.recompute.granularity"), "megarl captures the "
                    "update's forward and backward without activation recompute (its graphs "
                    "would not hold the recomputing backward)", "set actor.cuda_graphs=false or "
                    "actor.recompute.granularity=none")
    if actor.offload.param_offload:
        yield error(("actor.cuda_graphs", "actor.offload.param_offload"), "the update's graphs "
                    "read the parameters at the addresses they were captured with, and bringing "
                    "offloaded parameters back allocates them anew", "set "
                    "actor.offload.param_offload=false or actor.cuda_graphs=false")
    if cfg.resources.device == "cpu":
        yield warning(("actor.cuda_graphs", "resources.device"), "CUDA graphs need a GPU; the "
                      "update runs eagerly on the CPU", "set actor.cuda_graphs=false")


def check_training_safety(ctx: Context) -> Iterator[Problem]:
    """Gradient clipping off invites the NaN-after-some-steps failure (T5)."""
    if ctx.cfg.actor.grad_clip == 0:
        yield warning("actor.grad_clip", "gradient clipping is off", "set actor.grad_clip=1.0")


def check_validation_data(ctx: Context) -> Iterator[Problem]:
    """Validation every N steps needs validation files."""
    if ctx.cfg.trainer.val_every > 0 and not ctx.cfg.data.val_files:
        yield error(("trainer.val_every", "data.val_files"), "validation is scheduled but there "
                    "are no validation files", "add data.val_files or set trainer.val_every=0")


def check_optional_packages(ctx: Context) -> Iterator[Problem]:
    """Loggers and the reward function must be importable before workers start."""
    for logger, module in (("wandb", "wandb"), ("tensorboard", "tensorboard")):
        if logger in ctx.cfg.trainer.loggers and importlib.util.find_spec(module) is None:
            yield error("trainer.loggers", f"the {logger} logger is requested but {module} is not "
                        "installed",
                        f"pip install {module}, or remove {logger} from trainer.loggers")
    function = ctx.cfg.reward.function
    if function:
        module = function.rsplit(":", 1)[0]
        if module.endswith(".py"):
            if not Path(module).is_file():
                yield error("reward.function", f"file {module!r} does not exist", "check the "
                            "path (relative paths are taken from the working directory)")
            return
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            yield error("reward.function", f"module {module!r} cannot be found", "check the name "
                        "and that its directory is on PYTHONPATH")


def _import_path_problem(field: str, path: str) -> Problem | None:
    """An error when the module of ``package.module:name`` cannot be found."""
    module = path.partition(":")[0] if ":" in path else path.rpartition(".")[0]
    try:
        found = bool(module) and importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    return error(field, f"{path!r}: module {module!r} cannot be found", "write it as "
                 "'package.module:name' with the package on PYTHONPATH (built-in tools: "
                 "megarl.rollout.agent:calculator, megarl.rollout.agent:code_interpreter)")


def check_multi_turn(ctx: Context) -> Iterator[Problem]:
    """Multi-turn episodes need tools or an environment (not both), importable, and budgets
    that fit in ``data.max_response_length``."""
    mt, cfg = ctx.cfg.rollout.multi_turn, ctx.cfg
    if not mt.enable:
        return
    if not mt.tools and mt.env is None:
        yield error(("rollout.multi_turn.tools", "rollout.multi_turn.env"), "multi-turn "
                    "episodes need tools or an environment to answer the model",
                    "set rollout.multi_turn.tools=[megarl.rollout.agent:calculator] (or your "
                    "own), or rollout.multi_turn.env")
    if mt.tools and mt.env is not None:
        yield error(("rollout.multi_turn.tools", "rollout.multi_turn.env"), "both are set, but "
                    "an episode has one environment", "set one of them (an environment can "
                    "run tools itself)")
    for i, path in enumerate(mt.tools):
        problem = _import_path_problem(f"rollout.multi_turn.tools[{i}]", path)
        if problem is not None:
            yield problem
    if mt.env is not None and (problem := _import_path_problem("rollout.multi_turn.env",
                                                                mt.env)) is not None:
        yield problem
    if mt.max_tokens_per_turn is not None and (
            mt.max_tokens_per_turn > cfg.data.max_response_length):
        yield error(("rollout.multi_turn.max_tokens_per_turn", "data.max_response_length"),
                    f"a turn may generate {mt.max_tokens_per_turn} tokens but the whole episode "
                    f"after the prompt holds {cfg.data.max_response_length}",
                    f"set rollout.multi_turn.max_tokens_per_turn <= "
                    f"{cfg.data.max_response_length}, or null")


def _ignored_settings(cfg: RunConfig) -> list[tuple[str, bool, str]]:
    """(settings, ignored?, what turns them on) for options that only act with another one."""
    alg, sched_off = cfg.algorithm, cfg.scheduler.mode != "fully_async"
    full_rc = cfg.actor.recompute.granularity != "full"
    return [
        ("actor.ppo_max_token_len_per_gpu", not cfg.actor.use_dynamic_bsz,
         "set actor.use_dynamic_bsz=true"),
        ("actor.log_prob_micro_batch_size_per_gpu", cfg.actor.use_dynamic_bsz,
         ("set actor.use_dynamic_bsz=false (with it the forward packs by "
          "actor.ppo_max_token_len_per_gpu)")),
        ("ref.log_prob_micro_batch_size_per_gpu", cfg.actor.use_dynamic_bsz,
         ("set actor.use_dynamic_bsz=false (with it the forward packs by "
          "actor.ppo_max_token_len_per_gpu)")),
        ("actor.kl_loss_coef", not cfg.actor.use_kl_loss, "set actor.use_kl_loss=true"),
        ("actor.kl_loss_type", not cfg.actor.use_kl_loss, "set actor.use_kl_loss=true"),
        ("actor.recompute.method", full_rc, "set actor.recompute.granularity=full"),
        ("actor.recompute.num_layers", full_rc, "set actor.recompute.granularity=full"),
        ("actor.recompute.modules", cfg.actor.recompute.granularity != "selective",
         "set actor.recompute.granularity=selective"),
        ("algorithm.kl_ctrl", not alg.use_kl_in_reward, "set algorithm.use_kl_in_reward=true"),
        ("algorithm.kl_penalty", not alg.use_kl_in_reward, "set algorithm.use_kl_in_reward=true"),
        ("algorithm.lam", alg.adv_estimator != "gae", "set algorithm.adv_estimator=gae"),
        ("algorithm.norm_adv_by_std_in_grpo", alg.adv_estimator != "grpo",
         "set algorithm.adv_estimator=grpo"),
        ("algorithm.filter_groups.metric", not alg.filter_groups.enable,
         "set algorithm.filter_groups.enable=true"),
        ("algorithm.filter_groups.max_num_gen_batches", not alg.filter_groups.enable,
         "set algorithm.filter_groups.enable=true"),
        ("algorithm.rollout_correction.rollout_is_threshold",
         alg.rollout_correction.rollout_is is None, "set algorithm.rollout_correction.rollout_is"),
        ("algorithm.rollout_correction.rollout_rs_threshold",
         alg.rollout_correction.rollout_rs is None, "set algorithm.rollout_correction.rollout_rs"),
        ("scheduler.staleness_threshold", sched_off, "set scheduler.mode=fully_async"),
        ("scheduler.trigger_parameter_sync_step", sched_off, "set scheduler.mode=fully_async"),
        ("scheduler.partial_rollout", sched_off, "set scheduler.mode=fully_async"),
        ("scheduler.max_queue_length", sched_off, "set scheduler.mode=fully_async"),
        ("trainer.wandb_proxy", "wandb" not in cfg.trainer.loggers, "add wandb to trainer.loggers"),
        ("ref", not cfg.ref.enabled, "set actor.use_kl_loss=true or ref.enabled=true"),
        ("critic", not cfg.critic.enabled, "set algorithm.adv_estimator=gae"),
        ("rollout.multi_turn", not cfg.rollout.multi_turn.enable,
         "set rollout.multi_turn.enable=true"),
    ]


def check_settings_without_effect(ctx: Context) -> Iterator[Problem]:
    """Warn about values the user set that nothing will read in this configuration (S6)."""
    user_set = [p for p, origin in ctx.sources.items() if origin != "derived"]
    for setting, ignored, enable in _ignored_settings(ctx.cfg):
        hits = tuple(p for p in user_set if (p == setting or p.startswith(setting + "."))
                     and p not in ("ref.enabled", "critic.enabled",
                                   "rollout.multi_turn.enable"))
        if ignored and hits:
            yield warning(hits, "set but has no effect in this configuration",
                          f"{enable} to use it, or remove it")


RULES: tuple[Rule, ...] = (
    check_model_dir, check_model_weights, check_data_files, check_other_paths,
    check_mini_batch_divides_train_batch, check_micro_batch_sizes_exclusive,
    check_global_micro_batch_splits_over_dp, check_mini_batch_splits_over_dp,
    check_micro_batch_divides_mini_batch, check_dynamic_bsz_token_budget,
    check_critic_batch_split,
    *LAYOUT_RULES,
    check_pools_and_colocation, check_scheduler_needs_separate_pools, check_weight_sync_backend,
    check_rollout_bind_needs_api_key, check_device_settings, check_offload_param_and_optimizer,
    check_not_built, check_group_size, check_estimator_is_built, check_critic_for_gae,
    check_reference_layout, check_reference_for_kl, check_policy_loss_settings,
    check_rollout_correction, check_router_replay, check_cuda_graphs, check_training_safety,
    check_validation_data, check_optional_packages, check_multi_turn,
    check_settings_without_effect,
    check_memory_fits,
)


def file_problems(cfg: RunConfig, allow_missing_files: bool = False) -> list[Problem]:
    """Only the file checks (model dir and weights, data files, other paths), e.g. on every node."""
    ctx = build_context(cfg, allow_missing_files=allow_missing_files)
    return [replace(p, rule=rule.__name__)
            for rule in (check_model_dir, check_model_weights, check_data_files, check_other_paths)
            for p in rule(ctx)]


def build_context(cfg: RunConfig, model: ModelInfo | None = None, *,
                  sources: dict[str, str] | None = None, allow_missing_files: bool = False,
                  read_model: bool = True) -> Context:
    """The validation context: reads the model's config.json unless ``model`` is given."""
    model_error = None
    if model is None and read_model:
        try:
            model = load_model_info(cfg.model.path)
        except ModelInfoError as err:
            model_error = str(err)
    return Context(cfg=cfg, sizes=derive_sizes(cfg, model), model=model, model_error=model_error,
                   sources=dict(sources or {}), allow_missing_files=allow_missing_files)


def validate_config(cfg: RunConfig, model: ModelInfo | None = None, *,
                    sources: dict[str, str] | None = None, allow_missing_files: bool = False,
                    read_model: bool = True) -> list[Problem]:
    """Run every rule on ``cfg``; errors first, then warnings, each in rule order.

    ``model`` defaults to ``model.path``'s config.json. ``sources`` (from the loader) enables
    the warnings about settings without effect. ``allow_missing_files`` turns a missing model
    directory or data file into a warning (for configs whose files a later step creates).
    """
    return run_rules(build_context(cfg, model, sources=sources,
                                   allow_missing_files=allow_missing_files, read_model=read_model))


def run_rules(ctx: Context) -> list[Problem]:
    """Every rule on a built context; errors first, then warnings, each in rule order."""
    problems = [replace(p, rule=rule.__name__) for rule in RULES for p in rule(ctx)]
    return [p for p in problems if p.is_error] + [p for p in problems if not p.is_error]
