"""Every shipped config in configs/ validates: the demo against a real tiny model, the per-size
configs against their model cards (configs/models/*/config.json: architecture only, no weights)
with the data files and the checkpoint as the only, documented, placeholders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from megarl.config import load_config, validate_config
from megarl.config.cli import show_main, validate_main
from megarl.config.model_info import load_model_info, weight_files
from megarl.config.validate import file_problems

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "configs").glob("*.yaml"))
# model and data made by `megarl demo`
DEMOS = {"tiny-moe-cpu.yaml", "moe-gpu-demo.yaml", "tiny-moe-tools.yaml",
         "tiny-dense-lora-cpu.yaml", "moe-lora-gpu-demo.yaml"}
SIZED = [p for p in SHIPPED if p.name not in DEMOS]
CARDS = sorted(p for p in (REPO / "configs" / "models").iterdir() if p.is_dir())
PLACEHOLDER_RULES = {"check_model_weights", "check_data_files"}


def card_of(path: Path) -> str:
    """The name of the model card (configs/models/NAME) a sized config's model.path names."""
    return Path(yaml.safe_load(path.read_text())["model"]["path"]).name


def test_the_shipped_set():
    assert [p.stem for p in SHIPPED] == ["deepseek-v3-671b", "moe-gpu-demo", "moe-lora-gpu-demo",
                                         "qwen3-0.6b",
                                         "qwen3-235b-a22b", "qwen3-30b-a3b-32k",
                                         "qwen3-30b-a3b-lora-1gpu", "qwen3-30b-a3b", "qwen3-8b",
                                         "tiny-dense-lora-cpu", "tiny-moe-cpu", "tiny-moe-tools"]
    # every sized config points at a model card, and every card is used
    assert sorted({card_of(p) for p in SIZED}) == [c.name for c in CARDS]
    for path in SHIPPED:
        assert path.read_text().startswith("# "), f"{path.name} has no header comment"


@pytest.mark.parametrize("card", CARDS, ids=[c.name for c in CARDS])
def test_model_cards_are_config_json_only(card):
    assert [f.name for f in card.iterdir()] == ["config.json"]
    assert weight_files(card) == []
    info = load_model_info(card)
    assert info.num_layers > 0 and info.vocab_size > 0


def test_demo_config_validates_cleanly_against_the_tiny_model(tiny_moe_dir, tmp_path, capsys):
    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    train.write_bytes(b"")
    val.write_bytes(b"")
    assert validate_main([str(REPO / "configs" / "tiny-moe-cpu.yaml"), f"model.path={tiny_moe_dir}",
                          f"data.train_files=[{train}]", f"data.val_files=[{val}]"]) == 0
    assert capsys.readouterr().out == "OK\n"


def test_tools_demo_config_validates_against_the_tiny_model(tiny_moe_dir, tmp_path, capsys):
    """The tools demo's config (multi-turn, the calculator tool) against the demo's model
    architecture (the warm start changes weights only)."""
    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    train.write_bytes(b"")
    val.write_bytes(b"")
    assert validate_main([str(REPO / "configs" / "tiny-moe-tools.yaml"),
                          f"model.path={tiny_moe_dir}", f"data.train_files=[{train}]",
                          f"data.val_files=[{val}]"]) == 0
    assert capsys.readouterr().out == "OK\n"
    cfg, _ = load_config(REPO / "configs" / "tiny-moe-tools.yaml")
    assert cfg.rollout.multi_turn.enable
    assert cfg.rollout.multi_turn.tools == ["megarl.rollout.agent:calculator"]


def test_lora_demo_config_validates_against_its_tiny_dense_model(tmp_path, capsys):
    """The LoRA demo's config against the model `megarl demo --lora` draws (a dense Qwen3):
    adapters on every linear layer, so the MLP's too."""
    from megarl.data.tiny_model import make_tiny_model
    from megarl.demo import DEMOS

    spec = DEMOS["lora"]
    model = make_tiny_model(tmp_path / "model", arch=spec.arch, **spec.model)
    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    train.write_bytes(b"")
    val.write_bytes(b"")
    assert validate_main([str(spec.config), f"model.path={model}", f"data.train_files=[{train}]",
                          f"data.val_files=[{val}]"]) == 0
    assert capsys.readouterr().out == "OK\n"
    cfg, _ = load_config(spec.config)
    assert (cfg.actor.lora.rank, cfg.actor.lora.alpha) == (16, 32)
    assert cfg.actor.lora.target_modules is None  # every linear layer the model has


def test_the_one_gpu_lora_config_fits_where_the_full_fine_tune_cannot(monkeypatch):
    """configs/qwen3-30b-a3b-lora-1gpu.yaml: every phase fits the H200's 141 GB with LoRA (the
    preflight's estimates); the same run without adapters needs ~519 GB in the update."""
    from megarl.config.estimates import GB, estimate, phase_estimates
    from megarl.config.validate import build_context

    monkeypatch.chdir(REPO)
    path = REPO / "configs" / "qwen3-30b-a3b-lora-1gpu.yaml"
    lora, _ = load_config(path)
    ctx = build_context(lora)
    phases = phase_estimates(estimate(lora, ctx.model, ctx.sizes))
    assert set(phases) == {"gen", "old_log_prob", "update_actor", "sync_weights"}
    assert max(phases.values()) < 0.9 * 141 * GB, {k: v / GB for k, v in phases.items()}
    full, _ = load_config(path, ["actor.lora.rank=0"])
    ctx = build_context(full)
    update = estimate(full, ctx.model, ctx.sizes).update
    assert update.total > 3 * 141 * GB and update.state.optimizer > 300 * GB
    warned = [p for p in validate_config(full, allow_missing_files=True)
              if p.rule == "check_memory_fits"]
    assert warned and "in the update" in warned[0].line()


def test_the_gpu_lora_demo_trains_a_model_whose_full_fine_tune_does_not_fit_an_h100(
        tmp_path, monkeypatch):
    """`megarl demo --device cuda --lora`: its model (config.json of the demo's spec, the
    weights are drawn on the GPU) has Qwen3-30B-A3B's layers at 10.0B parameters; with LoRA every
    phase fits 141 GB; without adapters the update's step needs more than an H100's 80 GB (fp32
    grads and main weights, Adam's moments streamed: 10 bytes a parameter over the 18.6 GB (2^30
    bytes) of bf16 weights) and more than an H200's with the whole Adam state back (18)."""
    from megarl.config.estimates import GB, estimate, phase_estimates
    from megarl.config.model_info import load_model_info
    from megarl.config.validate import build_context
    from megarl.data.tiny_model import tiny_config_dict
    from megarl.demo import DEMOS, parse_demo

    spec, overrides = parse_demo(["--device", "cuda", "--lora", "trainer.total_steps=3"])
    assert spec is DEMOS["cuda-lora"] and overrides == ["trainer.total_steps=3"]
    assert spec.config == REPO / "configs" / "moe-lora-gpu-demo.yaml"
    assert (spec.dtype, spec.build_device, spec.task) == ("bfloat16", "cuda", "copy_number")
    card = tmp_path / "model"
    card.mkdir()
    fields = tiny_config_dict(spec.arch, **spec.model)
    (card / "config.json").write_text(json.dumps({**fields, "torch_dtype": spec.dtype}))
    info = load_model_info(card)
    assert (info.hidden_size, info.num_layers, info.num_experts) == (2048, 16, 128)
    # by hand: per layer q/k/v/o 2048x(4096+512+512) + 4096x2048, 128 experts of 3 x 2048x768,
    # the router 2048x128; plus the embeddings and the output layer (128 x 2048 each)
    per_layer = 2048 * 5120 + 4096 * 2048 + 128 * 3 * 2048 * 768 + 2048 * 128
    params = 16 * per_layer + 2 * 128 * 2048
    assert abs(params / 1e9 - 10.0) < 0.1
    monkeypatch.chdir(REPO)
    at_141 = [f"model.path={card}", "resources.gpu_memory_gb=141"]
    lora, _ = load_config(spec.config, at_141)
    assert (lora.actor.lora.rank, lora.actor.lora.sync) == (32, "adapter")
    ctx = build_context(lora)
    phases = phase_estimates(estimate(lora, ctx.model, ctx.sizes))
    assert max(phases.values()) < 141 * GB, {k: v / GB for k, v in phases.items()}
    assert phases["update_actor"] < 2 * params * 1.5  # the bf16 base and little else
    at_80 = [f"model.path={card}", "resources.gpu_memory_gb=80"]
    full, _ = load_config(spec.config, [*at_80, "actor.lora.rank=0"])
    ctx = build_context(full)
    update = estimate(full, ctx.model, ctx.sizes).update
    # colocated, the optimizer state comes to the GPU for the step only, which streams the Adam
    # moments: its 10 bytes a parameter (bf16 weights, fp32 grads and master copy) + 3 chunks
    # of moments (3 x the output layer's, 128 x 2048 x 8 bytes, below the 1 GiB chunk) alone
    # exceed an H100
    assert update.optimizer_deferred and update.total >= update.optimizer_step
    assert update.optimizer_step == 10 * params + 3 * GB > 80 * GB
    # the whole state back for the step: 18 bytes a parameter, more than an H200 holds
    whole, _ = load_config(spec.config, [*at_141, "actor.lora.rank=0",
                                         "actor.offload.optimizer_step_chunk_mb=0"])
    ctx = build_context(whole)
    assert estimate(whole, ctx.model, ctx.sizes).update.optimizer_step >= 18 * params > 141 * GB
    warned = [p for p in validate_config(full, allow_missing_files=True)
              if p.rule == "check_memory_fits"]
    assert warned and "in the update" in warned[0].line()
    assert not [p for p in validate_config(lora, allow_missing_files=True)
                if p.rule in ("check_memory_fits", "check_lora")]
    # the merged sync in bf16 without rollout correction is warned about (docs/lora.md)
    merged, _ = load_config(spec.config, [*at_141, "actor.lora.sync=merged"])
    lossy = [p for p in validate_config(merged, allow_missing_files=True)
             if p.rule == "check_lora"]
    assert len(lossy) == 1 and not lossy[0].is_error
    assert "rounded to bfloat16" in lossy[0].line()
    assert "actor.lora.sync=adapter" in lossy[0].line()
    corrected, _ = load_config(spec.config, [*at_141, "actor.lora.sync=merged",
                                             "algorithm.rollout_correction.rollout_is=token"])
    assert not [p for p in validate_config(corrected, allow_missing_files=True)
                if p.rule == "check_lora"]
    in_fp32, _ = load_config(spec.config, [*at_141, "actor.lora.sync=merged",
                                           "model.dtype=float32"])
    assert not [p for p in validate_config(in_fp32, allow_missing_files=True)
                if p.rule == "check_lora"]


def test_demo_arguments_choose_the_demo():
    from megarl.demo import DEMOS, parse_demo

    assert parse_demo([])[0] is DEMOS["cpu"]
    assert parse_demo(["--device", "cuda"])[0] is DEMOS["cuda"]
    assert parse_demo(["--lora"])[0] is DEMOS["lora"]
    assert parse_demo(["--tools", "trainer.total_steps=2"]) == (DEMOS["tools"],
                                                                 ["trainer.total_steps=2"])
    for bad in (["--tools", "--device", "cuda"], ["--tools", "--lora"], ["--device", "lora"]):
        with pytest.raises(SystemExit):
            parse_demo(bad)


def test_gpu_demo_config_validates_before_the_demo_ran(monkeypatch, capsys):
    """Only the files `megarl demo --device cuda` makes are missing (reported as warnings)."""
    monkeypatch.chdir(REPO)
    cfg, sources = load_config(REPO / "configs" / "moe-gpu-demo.yaml")
    problems = validate_config(cfg, sources=sources, allow_missing_files=True)
    assert all(not p.is_error for p in problems), [p.line() for p in problems]
    assert cfg.checkpoint_engine.backend == "ipc" and cfg.rollout.colocate
    assert validate_main([str(REPO / "configs" / "moe-gpu-demo.yaml"),
                          "--allow-missing-files"]) == 0
    assert capsys.readouterr().out.startswith("OK\n")


@pytest.mark.parametrize("path", SIZED, ids=[p.stem for p in SIZED])
def test_sized_config_validates_with_only_the_placeholders_reported(path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # model.path and the data placeholders are relative to the repo
    cfg, sources = load_config(path)
    assert cfg.model.path == f"configs/models/{card_of(path)}"
    problems = validate_config(cfg, sources=sources, allow_missing_files=True)
    assert {p.rule for p in problems} == PLACEHOLDER_RULES, [p.line() for p in problems]
    assert all(not p.is_error for p in problems)
    assert validate_main([str(path), "--allow-missing-files"]) == 0
    assert capsys.readouterr().out.startswith("OK\n")
    strict = validate_config(cfg, sources=sources)
    assert {p.rule for p in strict} == PLACEHOLDER_RULES and all(p.is_error for p in strict)


@pytest.mark.parametrize("path", SIZED, ids=[p.stem for p in SIZED])
def test_sized_config_with_real_files_validates_without_any_warning(path, tmp_path, capsys):
    """Replacing the placeholders (a checkpoint dir with weights, existing data) leaves nothing."""
    model = tmp_path / "checkpoint"
    model.mkdir()
    shutil.copy(REPO / "configs" / "models" / card_of(path) / "config.json", model / "config.json")
    (model / "model-00001-of-00001.safetensors").write_bytes(b"")
    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    train.write_bytes(b"")
    val.write_bytes(b"")
    assert validate_main([str(path), f"model.path={model}", f"data.train_files=[{train}]",
                          f"data.val_files=[{val}]"]) == 0
    assert capsys.readouterr().out == "OK\n"


def test_a_model_card_passes_the_checks_but_not_as_a_checkpoint(monkeypatch):
    """The architecture checks read config.json only; training needs weights (a missing file)."""
    monkeypatch.chdir(REPO)
    cfg, _ = load_config("configs/qwen3-30b-a3b.yaml", ["actor.parallel.ep=7"])
    problems = validate_config(cfg, allow_missing_files=True)
    assert any(p.rule == "check_experts_divisible_by_ep" for p in problems)  # the card was read
    (card,) = [p for p in problems if p.rule == "check_model_weights"]
    assert card.severity == "warning" and card.fields == ("model.path",)
    assert "no weights" in card.message and "HF checkpoint directory" in card.fix
    preflight = file_problems(cfg)  # what a node checks before training: an error
    assert (preflight[0].rule, preflight[0].severity) == ("check_model_weights", "error")


@pytest.mark.parametrize("path", SIZED, ids=[p.stem for p in SIZED])
def test_show_prints_the_parameter_counts(path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert show_main([str(path), "--allow-missing-files"]) == 0
    out = capsys.readouterr().out
    published = {"qwen3-0.6b": ("0.596B", "0.596B"), "qwen3-8b": ("8.19B", "8.19B"),
                 "qwen3-30b-a3b": ("30.5B", "3.35B"), "qwen3-235b-a22b": ("235B", "22.2B"),
                 "deepseek-v3-671b": ("671B", "37.6B")}[card_of(path)]
    assert f"#   params/total: {published[0]}\n" in out
    assert f"#   params/active: {published[1]}\n" in out
    assert "#   actor update " in out and "#   rollout GPU (engine of " in out


def test_moe_configs_use_router_replay_and_overlapping_schedulers():
    for name in ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3-671b"):
        cfg, _ = load_config(REPO / "configs" / f"{name}.yaml")
        assert cfg.actor.router_replay.mode == "R3" and cfg.rollout.enable_return_routed_experts
        assert cfg.scheduler.mode in ("one_step_off", "fully_async") and not cfg.rollout.colocate
        config = json.loads((REPO / "configs" / "models" / name / "config.json").read_text())
        assert config["num_experts_per_tok"] == 8


def test_multi_node_engines_are_flagged_only_when_one_node_would_do(monkeypatch):
    """DeepSeek-V3's bf16 weights need two nodes per engine; Qwen3-235B's fit one."""
    monkeypatch.chdir(REPO)
    cfg, _ = load_config("configs/qwen3-235b-a22b.yaml", ["rollout.gpus_per_engine=16"])
    found = [p for p in validate_config(cfg, allow_missing_files=True)
             if p.rule == "check_engines_fill_rollout_pool"]
    assert found and "crosses the network" in found[0].message
    cfg, _ = load_config("configs/deepseek-v3-671b.yaml")
    assert cfg.rollout.gpus_per_engine == 16
    assert all(p.rule != "check_engines_fill_rollout_pool"
               for p in validate_config(cfg, allow_missing_files=True))


def test_flags_may_come_before_overrides():
    from megarl.config.cli import validate_main

    assert validate_main(["configs/qwen3-8b.yaml", "--allow-missing-files",
                          "data.train_batch_size=128"]) == 0


def test_docs_config_reference_is_generated_from_the_schema():
    from pathlib import Path

    from megarl.config.docs import reference_page

    page = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert page.read_text() == reference_page(), (
        "docs/config.md is stale: run `python -m megarl.config.docs > docs/config.md`")


def test_long_response_config_splits_sequences_over_context_parallel_ranks(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    path = REPO / "configs" / "qwen3-30b-a3b-32k.yaml"
    cfg, _ = load_config(path)
    assert cfg.actor.parallel.cp == 2 and cfg.data.max_response_length == 32768
    assert show_main([str(path), "--allow-missing-files"]) == 0
    out = capsys.readouterr().out
    # the CP group's token budget (per GPU x cp) holds the longest sequence in one micro-batch
    assert "#   longest sequence          34816 tokens\n" in out
    assert "up to 36864 tokens each (per CP group)" in out
    assert "actor tp 4 x pp 1 x cp 2 x dp 2" in out
