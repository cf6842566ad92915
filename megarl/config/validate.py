"""Cross-field validation of a run config: one named rule per check, every problem collected and
reported at once as ``field(s): what is wrong — fix``, errors apart from warnings.

This module lists the rules in order (``RULES``) and runs them. The rules live by topic:
PITFALLS S3 (files readable before any worker starts) in validate_files.py, B2 (batch sizes that
divide) in validate_batch.py, the consistency of pools, schedulers and transports in
validate_pools.py, T7 (param + optimizer offload) and the algorithm and run options in
validate_options.py, B3-B5 (layout against the model's architecture) in validate_layout.py, T1
(memory per GPU) in estimates_report.py.
"""

from __future__ import annotations

from dataclasses import replace

from megarl.config.estimates import resolve_sizes
from megarl.config.estimates_report import check_memory_fits
from megarl.config.model_info import ModelInfo, ModelInfoError, load_model_info
from megarl.config.problems import Context, Problem
from megarl.config.schema import RunConfig
from megarl.config.validate_batch import (
    check_critic_batch_split,
    check_dynamic_bsz_token_budget,
    check_global_micro_batch_splits_over_dp,
    check_micro_batch_divides_mini_batch,
    check_micro_batch_sizes_exclusive,
    check_mini_batch_divides_train_batch,
    check_mini_batch_splits_over_dp,
)
from megarl.config.validate_files import (
    check_data_files,
    check_model_dir,
    check_model_weights,
    check_other_paths,
)
from megarl.config.validate_layout import LAYOUT_RULES, Rule
from megarl.config.validate_options import (
    check_critic_for_gae,
    check_cuda_graphs,
    check_estimator_is_built,
    check_fp8_attention,
    check_group_size,
    check_lora,
    check_multi_turn,
    check_not_built,
    check_offload_param_and_optimizer,
    check_optional_packages,
    check_policy_loss_settings,
    check_reference_for_kl,
    check_reference_layout,
    check_rollout_correction,
    check_router_replay,
    check_settings_without_effect,
    check_training_safety,
    check_validation_data,
)
from megarl.config.validate_pools import (
    check_device_settings,
    check_pools_and_colocation,
    check_rollout_bind_needs_api_key,
    check_scheduler_needs_separate_pools,
    check_sglang_only_settings,
    check_weight_sync_backend,
)

RULES: tuple[Rule, ...] = (
    check_model_dir, check_model_weights, check_data_files, check_other_paths,
    check_mini_batch_divides_train_batch, check_micro_batch_sizes_exclusive,
    check_global_micro_batch_splits_over_dp, check_mini_batch_splits_over_dp,
    check_micro_batch_divides_mini_batch, check_dynamic_bsz_token_budget,
    check_critic_batch_split,
    *LAYOUT_RULES,
    check_pools_and_colocation, check_scheduler_needs_separate_pools, check_weight_sync_backend,
    check_rollout_bind_needs_api_key, check_device_settings, check_sglang_only_settings,
    check_offload_param_and_optimizer,
    check_not_built, check_group_size, check_estimator_is_built, check_critic_for_gae,
    check_reference_layout, check_reference_for_kl, check_policy_loss_settings,
    check_rollout_correction, check_fp8_attention, check_router_replay, check_cuda_graphs,
    check_lora,
    check_training_safety,
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
    return Context(cfg=cfg, sizes=resolve_sizes(cfg, model), model=model, model_error=model_error,
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
