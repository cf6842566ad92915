"""Every input problem is one line naming the file or flag and the fix (exit code 2), and a
failed conversion leaves no output directory behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bridge.checks import ConversionError, Layout, staged_output
from bridge.cli import main, parse_size
from bridge.hf_to_mcore import hf_to_mcore
from bridge.verify import verify


def run_cli(capsys, *argv: str) -> str:
    """Run megarl-convert in-process; it must fail with exit code 2 and one stderr line."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"megarl-convert {argv[0]}: error: ")
    return err


def edited_copy(source: str, target: Path, **changes) -> Path:
    """A copy of an HF model directory whose config.json has ``changes`` applied."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    if "num_hidden_layers" in changes and "layer_types" in config:  # transformers checks these
        config["layer_types"] = config["layer_types"][:1] * changes["num_hidden_layers"]
    (target / "config.json").write_text(json.dumps(config))
    return target


def assert_nothing_left(out: Path) -> None:
    assert not out.exists()
    assert not list(out.parent.glob(f"{out.name}.incomplete-*"))


def test_wrong_paths(tiny_models, tmp_path, capsys):
    assert "no such directory" in run_cli(capsys, "hf-to-mcore", "--hf", str(tmp_path / "nope"),
                                          "--out", str(tmp_path / "o"))
    (tmp_path / "empty").mkdir()
    assert "no config.json" in run_cli(capsys, "verify", "--hf", str(tmp_path / "empty"))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(Path(tiny_models["qwen3"]) / "config.json", no_weights)
    assert "no *.safetensors" in run_cli(capsys, "hf-to-mcore", "--hf", str(no_weights),
                                         "--out", str(tmp_path / "o"))
    err = run_cli(capsys, "hf-to-mcore", "--hf", tiny_models["qwen3"], "--out", str(tmp_path))
    assert "already exists" in err
    err = run_cli(capsys, "mcore-to-hf", "--mcore", tiny_models["qwen3"], "--out",
                  str(tmp_path / "o"))
    assert "no megatron dist checkpoint" in err
    err = run_cli(capsys, "hf-to-mcore", "--hf", tiny_models["qwen3"], "--out",
                  str(tmp_path / "missing_parent" / "o"))
    assert "parent directory" in err


@pytest.mark.parametrize("model_type,expected", [
    ("gpt2", ("model_type 'gpt2' is not supported; supported: deepseek_v3, llama, mixtral, "
              "qwen2, qwen2_moe, qwen3, qwen3_moe")),
    ("glm4_moe", "model_type 'glm4_moe' is not supported; supported: deepseek_v3, llama"),
])
def test_unsupported_family(tiny_models, tmp_path, capsys, model_type, expected):
    model = edited_copy(tiny_models["qwen3"], tmp_path / "m", model_type=model_type)
    assert expected in run_cli(capsys, "hf-to-mcore", "--hf", str(model), "--out",
                               str(tmp_path / "o"))
    assert expected in run_cli(capsys, "verify", "--hf", str(model))


@pytest.mark.parametrize("name,flags,expected", [
    ("qwen3", ["--tp", "3"], ("--tp 3: the model's 4 attention heads do not split over 3 "
                              "ranks; use --tp 1, 2 or 4")),
    ("qwen3", ["--tp", "4"], "--tp 4: the model's 2 key/value heads do not split"),
    ("llama", ["--ep", "2"], "--ep 2: the model (llama) has no experts; use --ep 1"),
    ("qwen3_moe", ["--ep", "3"], "--ep 3: the model's 4 experts do not split over 3 ranks"),
    ("mixtral", ["--pp", "3"], "--pp 3: the model's 2 layers do not split over 3 ranks"),
])
def test_layout_that_does_not_divide_the_model(tiny_models, tmp_path, capsys, name, flags,
                                               expected):
    err = run_cli(capsys, "hf-to-mcore", "--hf", tiny_models[name], "--out",
                  str(tmp_path / "o"), *flags)
    assert expected in err
    assert_nothing_left(tmp_path / "o")


@pytest.mark.parametrize("changes,layout,expected", [
    ({"num_hidden_layers": 3}, Layout(tp=2), "config.json implies tensor model.layers.2."),
    # only the second pipeline stage finds its layers missing; both ranks report it
    ({"num_hidden_layers": 4}, Layout(pp=2), "config.json implies tensor model.layers.2."),
    ({"num_hidden_layers": 1}, Layout(tp=2), "tensors of the weights are not part of the model"),
    ({"intermediate_size": 96}, Layout(tp=2),
     ("model.layers.0.mlp.gate_proj.weight has shape [128, 64] in model.safetensors but "
      "config.json implies [96, 64]")),
])
def test_config_that_does_not_match_the_weights(tiny_models, ranks, tmp_path, changes, layout,
                                                 expected):
    """Checked on the ranks before any weight is loaded; the ranks stay usable."""
    model = edited_copy(tiny_models["qwen3"], tmp_path / "m", **changes)
    with pytest.raises(ConversionError, match="config.json does not describe these weights"
                       ) as err:
        hf_to_mcore(model, tmp_path / "o", layout, runner=ranks.runner)
    assert expected in str(err.value)
    assert "\n" not in str(err.value)
    assert_nothing_left(tmp_path / "o")
    assert ranks.alive


@pytest.mark.parametrize("changes,expected", [
    ({"num_hidden_layers": 4}, ("the checkpoint has 2 layers but config.json says "
                                "num_hidden_layers=4")),
    ({"hidden_size": 32}, "implies [128, 32]"),
    ({"num_local_experts": 8}, "4 experts per layer but config.json says 8"),
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
])
def test_export_with_a_config_of_another_model(tiny_models, converted, tmp_path, capsys,
                                               changes, expected):
    config_dir = edited_copy(tiny_models["qwen3_moe"], tmp_path / "cfg", **changes)
    err = run_cli(capsys, "mcore-to-hf", "--mcore", converted["qwen3_moe"], "--hf-config",
                  str(config_dir / "config.json"), "--out", str(tmp_path / "o"))
    assert expected in err
    assert_nothing_left(tmp_path / "o")


def test_training_checkpoint_without_config_needs_hf_config(converted, tmp_path, capsys):
    """A checkpoint with no HF config stored next to it asks for --hf-config."""
    bare = tmp_path / "runs" / "iter_0000010"
    shutil.copytree(converted["qwen3"], bare, ignore=shutil.ignore_patterns("hf"))
    (tmp_path / "runs" / "latest_checkpointed_iteration.txt").write_text("10")
    err = run_cli(capsys, "mcore-to-hf", "--mcore", str(tmp_path / "runs"), "--out",
                  str(tmp_path / "o"))
    assert "no HF config stored with the checkpoint; pass --hf-config" in err


def test_verify_refuses_a_checkpoint_of_another_family(tiny_models, converted):
    with pytest.raises(ConversionError, match="holds a qwen3_moe model but --hf"):
        verify(tiny_models["qwen3"], converted["qwen3_moe"])


def test_staged_output_is_removed_on_failure(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError), staged_output(out) as stage:
        (stage / "model-00001-of-00002.safetensors").write_bytes(b"partial")
        raise RuntimeError("interrupted")
    assert_nothing_left(out)
    with staged_output(out) as stage:
        (stage / "done").write_text("ok")
    assert (out / "done").read_text() == "ok"
    assert_nothing_left(tmp_path / "other")


def test_megarl_convert_is_this_cli():
    from megarl import cli

    assert cli.resolve("convert") is main


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1234") == 1234
    with pytest.raises(Exception, match="expected a size"):
        parse_size("5 parsecs")
