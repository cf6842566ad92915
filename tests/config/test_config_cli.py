"""``megarl config show|validate``, the shipped configs, and the generated field table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megarl.config import load_config, load_config_dict, validate_config
from megarl.config.cli import show_main, validate_main
from megarl.config.docs import fields_table
from megarl.config.loader import schema_fields
from megarl.config.not_built import NOT_BUILT

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "configs").glob("*.yaml"))
TINY = REPO / "configs" / "tiny-moe-cpu.yaml"


@pytest.fixture
def run_files(tmp_path: Path, tiny_moe_dir: Path) -> list[str]:
    """Overrides pointing the demo config at a real tiny model and real data files."""
    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    train.write_bytes(b"")
    val.write_bytes(b"")
    # pinned: the sizes these tests were written against (the demo itself is tuned to learn)
    return [f"model.path={tiny_moe_dir}", f"data.train_files=[{train}]",
            f"data.val_files=[{val}]", "data.train_batch_size=8", "rollout.n=4",
            "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=4",
            "data.max_response_length=32"]


def test_demo_config_validates_against_the_tiny_model(run_files, capsys):
    assert validate_main([str(TINY), *run_files]) == 0
    assert capsys.readouterr().out == "OK\n"


def test_demo_config_before_the_demo_ran(tmp_path, capsys):
    """Model and data do not exist yet: errors, or warnings with --allow-missing-files."""
    missing = [f"model.path={tmp_path}/model", f"data.train_files=[{tmp_path}/t.parquet]",
               f"data.val_files=[{tmp_path}/v.parquet]"]
    assert validate_main([str(TINY), *missing]) == 2
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"model.path: model directory {tmp_path}/model does not exist")
    assert len(out) == 3
    assert validate_main([str(TINY), *missing, "--allow-missing-files"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "OK" and all(line.startswith("warning: ") for line in out[1:])


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_configs_load_and_have_no_errors_but_missing_files(path):
    cfg, sources = load_config(path)
    problems = validate_config(cfg, sources=sources, allow_missing_files=True)
    assert [p.line() for p in problems if p.is_error] == []


def test_show_marks_sources_and_prints_sizes(run_files, capsys):
    assert show_main([str(TINY), *run_files, "rollout.n=8"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "  n: 8  # from override" in lines
    assert f"  backend: local  # from {TINY}" in lines
    assert "  top_p: 1.0" in lines  # a default: no mark
    assert "  enabled: false  # derived" in lines
    assert "#   sequences per step        8 prompts x 8 samples = 64" in lines
    assert "#   sequences per DP rank     32" in lines
    assert "#   train pool                2 processes: actor tp 1 x pp 1 x cp 1 x dp 2 " \
           "(experts: etp 1 x ep 2 x expert-dp 1 per stage)" in lines
    assert "# warnings" not in out and "# errors" not in out


def test_show_output_is_a_loadable_config(run_files, capsys):
    show_main([str(TINY), *run_files, "actor.optim.lr=3e-5"])
    shown = yaml.safe_load(capsys.readouterr().out)
    original, _ = load_config(TINY, [*run_files, "actor.optim.lr=3e-5"])
    again, _ = load_config_dict(shown)
    assert again == original


def test_show_lists_problems_and_still_exits_0(run_files, capsys):
    assert show_main([str(TINY), *run_files, "actor.ppo_micro_batch_size_per_gpu=3",
                      "actor.grad_clip=0"]) == 0
    out = capsys.readouterr().out
    assert "# errors (1)\n#   actor.ppo_micro_batch_size_per_gpu, actor.ppo_mini_batch_size" in out
    assert ("not a multiple of the micro-batch of 3 — set "
            "actor.ppo_micro_batch_size_per_gpu=2") in out
    assert "# warnings (1)\n#   actor.grad_clip: gradient clipping is off" in out


def test_validate_reports_every_problem_then_warnings(run_files, capsys):
    assert validate_main([str(TINY), *run_files, "data.train_batch_size=6",
                          "rollout.n=1", "actor.grad_clip=0"]) == 2
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("data.train_batch_size, actor.ppo_mini_batch_size: train_batch_size "
                             "6 is not a multiple of ppo_mini_batch_size 4 — set ")
    assert any(line.startswith("rollout.n, algorithm.adv_estimator:") for line in out[1:-1])
    assert out[-1].startswith("warning: actor.grad_clip:")
    assert "OK" not in out


def test_unloadable_config_exits_2_with_lines(capsys):
    assert validate_main([str(TINY), "actor.ppo_epoch=2"]) == 2
    assert capsys.readouterr().out == ("actor.ppo_epoch: unknown key (in override) — did you "
                                       "mean actor.ppo_epochs?\n")
    assert show_main(["/nonexistent.yaml"]) == 2


# Overrides that make each NOT_BUILT entry apply; a new entry needs one here.
NOT_BUILT_TRIGGERS: dict[str, tuple[str, ...]] = {
    "checkpoint_engine.backend": ("checkpoint_engine.backend=disk",),
    "algorithm.filter_groups.metric": ("algorithm.filter_groups.metric=acc",),
    "algorithm.rollout_correction.bypass_mode": ("algorithm.rollout_correction.bypass_mode=true",
                                                 "algorithm.rollout_correction.rollout_is=token"),
    "algorithm.kl_penalty": ("algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=full"),
    "actor.router_replay.mode": ("actor.router_replay.mode=R2",
                                 "algorithm.rollout_correction.bypass_mode=true"),
}


@pytest.mark.parametrize("entry", NOT_BUILT, ids=[entry[0] for entry in NOT_BUILT])
def test_validate_reports_what_is_not_built(entry, run_files, capsys):
    """`megarl config validate` refuses what `megarl train` cannot run, with the field and fix."""
    field, _, fix = entry
    assert field in NOT_BUILT_TRIGGERS, f"add overrides that make {field}'s entry apply"
    assert validate_main([str(TINY), *run_files, *NOT_BUILT_TRIGGERS[field]]) == 2
    out = capsys.readouterr().out.splitlines()
    assert f"{field}: not built in this version of megarl — {fix}" in out


def test_usage_error_is_exit_2(capsys):
    assert validate_main([]) == 2
    assert "usage: megarl config validate" in capsys.readouterr().err


def test_megarl_command_dispatches_to_config(run_files):
    out = subprocess.run([sys.executable, "-m", "megarl.cli", "config", "validate", str(TINY),
                          *run_files], check=False, capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert (out.returncode, out.stdout) == (0, "OK\n"), out.stderr


def test_fields_table_lists_every_leaf_field():
    table = fields_table()
    lines = table.splitlines()
    assert lines[0] == "| field | type | default | description |"
    assert "| `actor.parallel.tp` | int | `1` | tensor-model-parallel size" in table
    assert "| `rollout.max_num_seqs` | int \\| 'auto' | `auto` |" in table
    assert "| `model.path` | str | `required` |" in table
    assert "| `resources.rollout_pool` | section \\| null | `null` |" in table
    assert "| `critic.optim` | section | `{lr: 1.0e-05, weight_decay: 0.01" in table
    assert "same fields as `actor.optim`" in table and "`critic.optim.lr`" not in table
    assert "| `ref.parallel` | section \\| null | `null` |" in table
    assert "same fields as `actor.parallel`" in table and "`ref.parallel.tp`" not in table
    leaves = [p for p in schema_fields() if not any(
        q.startswith(p + ".") for q in schema_fields())]
    listed = [p for p in leaves if f"| `{p}` |" in table]
    # not repeated: ref/critic parallel (7 each), critic optim (6) and offload (4), rollout_pool (2)
    assert len(listed) == len(leaves) - 7 - 7 - 6 - 4 - 2
    assert fields_table(["ray"]).count("\n") == 2 + 3


@pytest.mark.parametrize("memory", [None, "resources.gpu_memory_gb=80"])
def test_train_startup_prints_the_estimates_config_show_reports(run_files, capsys, memory):
    """T1: ``megarl train`` prints the per-GPU memory estimate at start, gpu_memory_gb or not,
    with the very numbers of ``config show``."""
    from megarl.trainer import startup_text

    overrides = [*run_files] + ([memory] if memory else [])
    show_main([str(TINY), *overrides])
    shown = [line.removeprefix("#   ") for line in capsys.readouterr().out.splitlines()]
    cfg, _ = load_config(TINY, overrides)
    text = startup_text(cfg)
    assert text[0].startswith("megarl: memory estimate per GPU")
    assert ("estimate only: resources.gpu_memory_gb is unknown" in text[0]) == (memory is None)
    rows = [line.removeprefix("megarl:   ") for line in text[1:]]
    assert any(r.startswith("actor update") and "optimizer" in r and "activations" in r
               for r in rows)
    assert any(r.startswith("host memory") and "CPU run" in r for r in rows)
    assert rows and all(r in shown for r in rows)


def test_train_main_prints_the_estimate_before_it_starts(run_files, capsys, monkeypatch):
    """``megarl train`` prints :func:`startup_text` first, once (rank 0)."""
    from megarl.data.dataset import DatasetError
    from megarl.trainer import main as trainer_mod

    class Stub:
        def __init__(self, cfg, sources):
            pass

        def setup(self):
            raise DatasetError("stub: stop before any worker starts")

        def close(self):
            pass

    monkeypatch.setattr(trainer_mod, "Trainer", Stub)
    monkeypatch.delenv("RANK", raising=False)
    assert trainer_mod.train_main(["--config", str(TINY), *run_files]) == 2
    out = capsys.readouterr().out.splitlines()
    cfg, _ = load_config(TINY, run_files)
    assert out == trainer_mod.startup_text(cfg)


def test_fp8_rollout_defaults_and_sglangs_block_rule(run_files, capsys):
    """rollout.quantization=fp8: on SGLang the tiny model's 64-wide q projection is no whole
    128-block, so one line names the field, why, and the ways out; the embedded engine takes it.
    With fp8, rollout correction turns on unless set."""
    base = [str(TINY), *run_files, "rollout.quantization=fp8"]
    assert validate_main([*base, "rollout.backend=sglang"]) == 2
    lines = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("rollout.quantization")]
    assert len(lines) == 1
    assert "multiples of 128 per GPU" in lines[0] and "q 64" in lines[0]
    assert "rollout.backend=local" in lines[0]
    assert validate_main([*base, "rollout.backend=local"]) == 0
    cfg, _ = load_config(TINY, [*run_files, "rollout.quantization=fp8"])
    assert cfg.algorithm.rollout_correction.rollout_is == "token"
    cfg, _ = load_config(TINY, [*run_files, "rollout.quantization=fp8",
                                "algorithm.rollout_correction.rollout_is=null"])
    assert cfg.algorithm.rollout_correction.rollout_is is None
    cfg, _ = load_config(TINY, run_files)
    assert cfg.algorithm.rollout_correction.rollout_is is None
