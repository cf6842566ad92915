"""Validation rules of the files (PITFALLS S3): the model directory and its weights, the data
files and the other paths, readable before any worker starts."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from megarl.config.model_info import weight_files
from megarl.config.problems import Context, Problem, error


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
