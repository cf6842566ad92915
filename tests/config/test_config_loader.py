"""Loading: precedence (override > YAML > default), source tracking, unknown keys with the
nearest valid names (verl's names translated), and one readable line per type error."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megarl.config import ConfigError, load_config, load_config_dict
from megarl.config.loader import parse_override, schema_fields, suggest_keys

MINIMAL = {"model": {"path": "/m"}, "data": {"train_files": ["/d/train.parquet"]}}


def write_yaml(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def error_lines(data: dict, *overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config_dict(data, overrides, origin="run.yaml")
    return info.value.lines


def test_override_beats_yaml_beats_default(tmp_path):
    path = write_yaml(tmp_path, {**MINIMAL, "rollout": {"n": 4, "temperature": 0.7}})
    cfg, sources = load_config(path, ["rollout.n=16"])
    assert cfg.rollout.n == 16 and sources["rollout.n"] == "override"
    assert cfg.rollout.temperature == 0.7 and sources["rollout.temperature"] == str(path)
    assert cfg.rollout.top_p == 1.0 and "rollout.top_p" not in sources


def test_derived_fields_follow_their_source_and_are_marked():
    cfg, sources = load_config_dict(MINIMAL, ["actor.use_kl_loss=true",
                                              "actor.ppo_micro_batch_size_per_gpu=2"])
    assert cfg.ref.enabled is True and sources["ref.enabled"] == "derived"
    assert cfg.ref.parallel == cfg.actor.parallel and sources["ref.parallel"] == "derived"
    assert cfg.actor.log_prob_micro_batch_size_per_gpu == 2
    budgets, sources = load_config_dict(MINIMAL, ["actor.ppo_max_token_len_per_gpu=8192"])
    assert budgets.actor.log_prob_max_token_len_per_gpu == 8192  # the update's budget
    assert budgets.ref.log_prob_max_token_len_per_gpu == 8192  # the actor's log-prob budget
    assert sources["ref.log_prob_max_token_len_per_gpu"] == "derived"
    own, _ = load_config_dict(MINIMAL, ["actor.log_prob_max_token_len_per_gpu=32768"])
    assert own.ref.log_prob_max_token_len_per_gpu == 32768
    assert cfg.model.tokenizer_path == "/m" and cfg.rollout.dtype == cfg.model.dtype
    explicit, sources = load_config_dict(MINIMAL, ["ref.enabled=false", "model.tokenizer_path=/t"])
    assert explicit.ref.enabled is False and sources["ref.enabled"] == "override"
    assert explicit.model.tokenizer_path == "/t"


def test_override_values_are_yaml_scalars_and_lists():
    cfg, _ = load_config_dict(MINIMAL, [
        "data.train_files=[/a.parquet, /b.parquet]", "rollout.max_num_seqs=256",
        "actor.optim.lr=3e-6", "rollout.api_key=null", "trainer.loggers=[console]",
        "actor.parallel.vpp=", "actor.optim.betas=[0.9, 0.95]"])
    assert cfg.data.train_files == ["/a.parquet", "/b.parquet"]
    assert cfg.rollout.max_num_seqs == 256 and cfg.actor.optim.lr == 3e-6
    assert cfg.rollout.api_key is None and cfg.actor.parallel.vpp is None
    assert cfg.actor.optim.betas == (0.9, 0.95)


def test_override_creates_a_null_section_and_merges_mappings(tmp_path):
    path = write_yaml(tmp_path, {**MINIMAL, "resources": {"rollout_pool": None,
                                                        "train_pool": {"nnodes": 2}}})
    cfg, sources = load_config(path, ["resources.rollout_pool.gpus_per_node=4",
                                      "resources.train_pool={gpus_per_node: 4}"])
    assert cfg.resources.rollout_pool.world_size == 4  # nnodes from the default
    assert cfg.resources.train_pool.world_size == 8  # nnodes 2 kept from the file
    assert sources["resources.train_pool.nnodes"] == str(path)
    assert sources["resources.train_pool.gpus_per_node"] == "override"


def test_single_train_file_string_is_a_list():
    cfg, _ = load_config_dict({"model": {"path": "/m"}, "data": {"train_files": "/x.parquet"}})
    assert cfg.data.train_files == ["/x.parquet"]


def test_unknown_key_suggests_nearest_sibling():
    lines = error_lines(MINIMAL, "actor.clip_ratio_hgih=0.28")
    assert lines == [("actor.clip_ratio_hgih: unknown key (in override) — did you mean "
                     "actor.clip_ratio_high?")]


def test_unknown_key_in_file_names_the_file_and_full_path():
    lines = error_lines({**MINIMAL, "actor": {"parallel": {"tensor_parallel": 2}}})
    assert lines[0].startswith("actor.parallel.tensor_parallel: unknown key (in run.yaml)")


def test_key_in_the_wrong_section_points_to_where_it_lives():
    (line,) = error_lines(MINIMAL, "actor.tp=2")
    assert "did you mean actor.parallel.tp" in line


@pytest.mark.parametrize("verl_key,megarl_key", [
    ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size", "actor.parallel.tp"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size", "rollout.gpus_per_engine"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size", "actor.ppo_mini_batch_size"),
    ("trainer.n_gpus_per_node", "resources.train_pool.gpus_per_node"),
    ("ray_init.timeline_json_file", "ray.timeline_file"),
    ("trainer.save_freq", "trainer.save_every"),
    ("async_training.staleness_threshold", "scheduler.staleness_threshold"),
    ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
     "actor.log_prob_max_token_len_per_gpu"),
])
def test_verl_names_are_translated_in_suggestions(verl_key, megarl_key):
    assert suggest_keys(verl_key) == [megarl_key]
    (line,) = error_lines(MINIMAL, f"{verl_key}=2")
    assert line.endswith(f"did you mean {megarl_key}?")


def test_unknown_section_lists_valid_ones():
    (line,) = error_lines(MINIMAL, "zzz.qqq=1")
    assert line.startswith("zzz.qqq: unknown key (in override) — valid top-level sections: "
                           "model, data")


@pytest.mark.parametrize("override,expected", [
    ("actor.ppo_epochs=two", ("actor.ppo_epochs: 'two' (from override) is not a whole number — "
                             "use a whole number, e.g. actor.ppo_epochs=1")),
    ("algorithm.adv_estimator=grp", ("algorithm.adv_estimator: 'grp' (from override) is not one "
                                    "of 'grpo', 'grpo_passk', 'rloo', 'opo', 'gpg', "
                                    "'reinforce_plus_plus', 'reinforce_plus_plus_baseline', "
                                    "'remax' or 'gae' (did you "
                                    "mean 'grpo'?)")),
    ("rollout.max_num_seqs=many", ("rollout.max_num_seqs: 'many' (from override) is not a whole "
                                  "number or one of 'auto'")),
    ("data.train_batch_size=0", ("data.train_batch_size: 0 (from override) is out of range, it "
                                "must be >= 1 — use a value >= 1, e.g. data.train_batch_size=64")),
    ("rollout.gpu_memory_utilization=1.5", ("rollout.gpu_memory_utilization: 1.5 (from override) "
                                           "is out of range, it must be <= 1")),
    ("actor.use_kl_loss=maybe", "actor.use_kl_loss: 'maybe' (from override) is not true or false"),
    ("resources.train_pool=8", ("resources.train_pool: 8 (from override) is not a mapping of its "
                               "fields")),
    ("trainer.loggers=[console, wandbb]", ("trainer.loggers.1: 'wandbb' (from override) is not one"
                                          " of 'console', 'jsonl', 'tensorboard' or 'wandb' (did "
                                          "you mean 'wandb'?)")),
    ("reward.function=abc", ("reward.function: 'abc' is not of the form 'package.module:function'"
                            " or 'path/to/file.py:function' (from override) — fix the value")),
])
def test_type_errors_are_one_line_each(override, expected):
    lines = error_lines(MINIMAL, override)
    assert len(lines) == 1, lines
    assert lines[0].startswith(expected), lines[0]
    assert " — " in lines[0]


def test_all_problems_are_reported_at_once():
    lines = error_lines({"data": {"train_files": []}}, "actor.ppo_epochs=x", "actor.foo=1")
    joined = "\n".join(lines)
    assert "model: required but not set — add it to the YAML file or pass model=VALUE" in joined
    assert "data.train_files: list should have at least 1 item" in joined
    assert "actor.ppo_epochs:" in joined and "actor.foo: unknown key" in joined
    assert len(lines) == 4


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  path: /m\ndata: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (line,) = info.value.lines
    assert line.startswith(f"{path}: line 4") and "YAML syntax error" in line


def test_missing_file_and_non_mapping_file(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "none.yaml")
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level is a list, not a mapping"):
        load_config(path)


def test_malformed_override_is_rejected():
    with pytest.raises(ConfigError, match="not an override — write dotted.key=value"):
        parse_override("rollout.n")
    with pytest.raises(ConfigError, match="not an override"):
        parse_override("a..b=1")
    assert parse_override("a.b= x=y") == ("a.b", "x=y")


def test_every_field_has_a_description():
    undocumented = [path for path, info in schema_fields().items() if not info.description]
    assert undocumented == []


def test_resolved_config_round_trips():
    cfg, _ = load_config_dict(MINIMAL, ["rollout.n=4", "algorithm.adv_estimator=gae"])
    again, _ = load_config_dict(cfg.model_dump(mode="json"))
    assert again == cfg


def test_reward_function_file_path_form_is_checked(tmp_path):
    from megarl.config import load_config_dict, validate_config

    script = tmp_path / "my_reward.py"
    script.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                      "    return 1.0\n")
    base = {**MINIMAL, "model": {"path": str(tmp_path)}}
    cfg, _ = load_config_dict(base, [f"reward.function={script}:compute_score"])
    assert not [p for p in validate_config(cfg, read_model=False, allow_missing_files=True)
                if "reward.function" in p.fields]
    cfg, _ = load_config_dict(base, [f"reward.function={tmp_path}/missing.py:compute_score"])
    lines = [p.line() for p in validate_config(cfg, read_model=False, allow_missing_files=True)
             if "reward.function" in p.fields]
    assert lines and "missing.py' does not exist" in lines[0]
