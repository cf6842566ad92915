"""megarl's run configuration: pydantic schema, YAML + dotted overrides, cross-field validation
against the model's architecture, and the derived batch/layout sizes.

    cfg, sources = load_config("configs/tiny-moe-cpu.yaml", ["rollout.n=4"])
    problems = validate_config(cfg, sources=sources)
    sizes = resolve_sizes(cfg, load_model_info(cfg.model.path))  # derive_sizes + engine room
    lines = format_estimates(cfg, load_model_info(cfg.model.path), sizes)  # params and memory
"""

from megarl.config.derived import DerivedSizes, RoleLayout, derive_sizes
from megarl.config.estimates import Estimates, estimate, resolve_sizes
from megarl.config.estimates_report import format_estimates
from megarl.config.loader import ConfigError, load_config, load_config_dict
from megarl.config.model_info import ModelInfo, ModelInfoError, load_model_info
from megarl.config.problems import Problem
from megarl.config.render import render_config
from megarl.config.schema import RunConfig
from megarl.config.validate import validate_config

__all__ = [
    "ConfigError", "DerivedSizes", "Estimates", "ModelInfo", "ModelInfoError", "Problem",
    "RoleLayout", "RunConfig", "derive_sizes", "estimate", "format_estimates", "load_config",
    "load_config_dict", "load_model_info", "render_config", "resolve_sizes", "validate_config",
]
