"""Validation rules of the algorithm and run options: offload (T7), what is not built, group
sizes and estimators, critic and reference, policy loss, rollout correction, router replay,
CUDA graphs, training safety, validation data, optional packages, multi-turn, and the settings
that have no effect in a configuration (S6)."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator
from pathlib import Path

from megarl.config.lora_layers import resolve_targets, selection_problems
from megarl.config.not_built import NOT_BUILT
from megarl.config.problems import Context, Problem, error, warning
from megarl.config.schema import RunConfig


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


def check_fp8_attention(ctx: Context) -> Iterator[Problem]:
    """``rollout.fp8_attention`` chooses what an FP8 engine quantizes: nothing without FP8."""
    rollout = ctx.cfg.rollout
    if not rollout.fp8_attention and rollout.quantization != "fp8":
        yield error(("rollout.fp8_attention", "rollout.quantization"), "keeps the attention "
                    "projections out of FP8, but the engines do not quantize "
                    f"(rollout.quantization={rollout.quantization})",
                    "set rollout.quantization=fp8, or remove rollout.fp8_attention")


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


def engines_start_without_weights(cfg: RunConfig) -> bool:
    """Whether the engines start from dummy weights, so that the trainer must sync before the
    first generation: asked for (``rollout.load_format=dummy``), or SGLang in block FP8
    (``rollout.quantization=fp8``), which builds its fp8 parameters from an FP8-serialized
    config only (docs/fp8.md)."""
    return cfg.rollout.load_format == "dummy" or (cfg.rollout.backend == "sglang"
                                                  and cfg.rollout.quantization == "fp8")


def check_lora(ctx: Context) -> Iterator[Problem]:
    """LoRA adapters must select layers of the model, and what they cannot run with is refused:
    CUDA graphs (the graphed update does not cover the adapters), multi-latent attention (no
    linear_qkv; its adapters are not built)."""
    cfg = ctx.cfg
    lora = cfg.actor.lora
    if lora.rank == 0:
        return
    if cfg.actor.cuda_graphs:
        yield error(("actor.lora.rank", "actor.cuda_graphs"), "megarl's CUDA-graphed update "
                    "captures the full-weight layers; its graphs do not run the adapters",
                    "set actor.cuda_graphs=false or actor.lora.rank=0")
    if lora.sync == "adapter" and engines_start_without_weights(cfg):
        yield error(("actor.lora.sync", "rollout.load_format"), "the engines start from dummy "
                    "weights (rollout.load_format=dummy, or SGLang in fp8) and the adapter sync "
                    "never sends them the base, so they could never generate",
                    "set rollout.load_format=auto (and rollout.quantization=null on SGLang) or "
                    "actor.lora.sync=merged")
    if (lora.sync == "merged" and cfg.rollout.dtype != "float32"  # resolved: model.dtype
            and cfg.algorithm.rollout_correction.rollout_is is None):
        yield warning(("actor.lora.sync", "rollout.dtype",
                       "algorithm.rollout_correction.rollout_is"),
                      f"the merged sync sends W + alpha/r * B A rounded to {cfg.rollout.dtype}: "
                      "while the adapters' change is small against the base's rounding step, "
                      "much of it is lost there and the engine samples from another policy "
                      "(the GPU LoRA demo: training/rollout_probs_diff_mean up to 0.077, 0.002 "
                      "with the adapter sync; docs/lora.md)",
                      "set actor.lora.sync=adapter (the engine adds the adapters to the base "
                      "itself) or algorithm.rollout_correction.rollout_is=token")
    if lora.sync == "adapter" and cfg.model.mcore_checkpoint:
        yield error(("actor.lora.sync", "model.mcore_checkpoint"), "the adapter sync sends "
                    "only the adapters, so the engines keep model.path as their base, while the "
                    "actor's base comes from the checkpoint", "set actor.lora.sync=merged")
    model = ctx.model
    if model is None:
        return
    if model.kv_lora_rank:
        yield error(("actor.lora.rank", "model.path"), f"{model.model_type} uses multi-latent "
                    "attention, whose projections have no LoRA adapters yet (not built)",
                    "set actor.lora.rank=0")
        return
    moe_layers = [model.is_moe and i not in model.dense_layers for i in range(model.num_layers)]
    shared = model.shared_expert_ffn_hidden_size > 0
    targets = resolve_targets(moe_layers, shared, lora.target_modules)
    for problem in selection_problems(moe_layers, shared, targets, lora.exclude_modules):
        field, _, message = problem.partition(": ")
        yield error(f"actor.lora.{field}", message, "choose targets and patterns that name "
                    "this model's layers (layers.{i}.{path}; see `megarl config show`)")
    experts = [t for t in targets if t.startswith("experts.")]
    if experts and lora.dropout:
        yield error(("actor.lora.dropout", "actor.lora.target_modules"), "the routed experts' "
                    "adapters have no dropout (nor have PEFT's on HF's fused experts)",
                    "set actor.lora.dropout=0, or drop experts.* from the targets")
    p = cfg.actor.parallel
    etp = p.expert_tp
    if experts and etp not in (1, p.tp):
        yield error(("actor.lora.target_modules", "actor.parallel.etp"), f"routed-expert "
                    f"adapters run with expert-TP 1 or equal to TP (got etp={etp}, tp={p.tp}): "
                    "an adapter repeated on the expert-TP ranks is counted once in the grad norm "
                    "through the dense TP group", "set actor.parallel.etp=1 or to actor.parallel.tp")


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
        ("actor.log_prob_max_token_len_per_gpu", not cfg.actor.use_dynamic_bsz,
         "set actor.use_dynamic_bsz=true"),
        ("ref.log_prob_max_token_len_per_gpu", not cfg.actor.use_dynamic_bsz,
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
        *((f"{role}.offload.optimizer_step_chunk_mb", not offload.optimizer_offload,
           f"set {role}.offload.optimizer_offload=true (the chunks stream that state)")
          for role, offload in (("actor", cfg.actor.offload), ("critic", cfg.critic.offload))),
        ("scheduler.staleness_threshold", sched_off, "set scheduler.mode=fully_async"),
        ("scheduler.trigger_parameter_sync_step", sched_off, "set scheduler.mode=fully_async"),
        ("scheduler.partial_rollout", sched_off, "set scheduler.mode=fully_async"),
        ("scheduler.max_queue_length", sched_off, "set scheduler.mode=fully_async"),
        ("trainer.wandb_proxy", "wandb" not in cfg.trainer.loggers, "add wandb to trainer.loggers"),
        ("ray", cfg.trainer.worker_group == "naive",
         "set trainer.worker_group=ray (the no-Ray mode starts no Ray: no timeline, no address)"),
        ("ref", not cfg.ref.enabled, "set actor.use_kl_loss=true or ref.enabled=true"),
        ("critic", not cfg.critic.enabled, "set algorithm.adv_estimator=gae"),
        ("actor.lora", cfg.actor.lora.rank == 0, "set actor.lora.rank > 0"),
        ("rollout.multi_turn", not cfg.rollout.multi_turn.enable,
         "set rollout.multi_turn.enable=true"),
    ]


def check_settings_without_effect(ctx: Context) -> Iterator[Problem]:
    """Warn about values the user set that nothing will read in this configuration (S6)."""
    user_set = [p for p, origin in ctx.sources.items() if origin != "derived"]
    for setting, ignored, enable in _ignored_settings(ctx.cfg):
        hits = tuple(p for p in user_set if (p == setting or p.startswith(setting + "."))
                     and p not in ("ref.enabled", "critic.enabled",
                                   "rollout.multi_turn.enable", "actor.lora.rank"))
        if ignored and hits:
            yield warning(hits, "set but has no effect in this configuration",
                          f"{enable} to use it, or remove it")
