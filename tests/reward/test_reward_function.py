"""Loading ``reward.function`` by module path and by file path, and the errors for wrong ones."""

import sys
from pathlib import Path

import pytest

from megarl.reward.function import RewardFunctionError, absolute_spec, load_reward_function

HERE = Path(__file__).resolve().parent
FNS_FILE = HERE / "reward_fns.py"


@pytest.fixture
def fns_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    yield "reward_fns"
    sys.modules.pop("reward_fns", None)


def test_module_path(fns_on_path):
    fn = load_reward_function(f"{fns_on_path}:exact_match")
    assert fn(data_source="d", solution_str=" 7 ", ground_truth="7", extra_info={}) == 1.0


def test_file_path_absolute_and_relative(monkeypatch):
    fn = load_reward_function(f"{FNS_FILE}:exact_match")
    assert fn(data_source="d", solution_str="7", ground_truth="8", extra_info={}) == 0.0
    monkeypatch.chdir(HERE.parent)
    relative = f"{HERE.name}/reward_fns.py:exact_match"
    assert load_reward_function(relative) is fn
    assert absolute_spec(relative) == f"{FNS_FILE}:exact_match"


def test_batched_signature_is_checked(fns_on_path):
    load_reward_function(f"{fns_on_path}:batch_exact_match", batched=True)
    with pytest.raises(RewardFunctionError, match="reward.batched=true"):
        load_reward_function(f"{fns_on_path}:batch_exact_match")


@pytest.mark.parametrize("spec, expected", [
    ("no_such_module_xyz:fn", "no module named 'no_such_module_xyz'"),
    ("megarl.no_such_module:fn", "no module named 'megarl.no_such_module'"),
    ("reward_fns:no_such_fn", ("has no attribute 'no_such_fn'; callables defined there: "
                               "batch_exact_match, exact_match, misbehaving")),
    ("reward_fns:NOT_CALLABLE", r"'NOT_CALLABLE' is not callable \(type int\)"),
    ("reward_fns:wrong_arguments", "cannot be called as a per-sample reward function"),
    ("reward_fns", "expected 'package.module:callable' or 'path/to/file.py:callable'"),
    ("reward_fns:", "expected"),
    ("missing/file.py:fn", "file .*missing/file.py not found"),
])
def test_wrong_specs_name_the_field_and_the_problem(fns_on_path, spec, expected):
    with pytest.raises(RewardFunctionError, match="reward.function=") as info:
        load_reward_function(spec)
    assert info.match(expected)


def test_error_inside_the_users_module_is_reported(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import not_installed_dependency_xyz\n")
    with pytest.raises(RewardFunctionError, match="executing .*broken.py failed: "
                       "ModuleNotFoundError: No module named 'not_installed_dependency_xyz'"):
        load_reward_function(f"{broken}:fn")
