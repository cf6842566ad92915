"""How ``pytest -n 2`` splits the suite (tests/xdist_units.py): a directory with a session-scoped
fixture stays in one worker, and the costliest units go first."""

from __future__ import annotations

from xdist_units import FILE_SECONDS, order_by_unit_cost, unit_of


def test_files_sharing_a_session_fixture_run_in_one_unit():
    # the resumed, naive and LoRA runs compare with the trainer's one reference run
    for name in ("test_resume.py", "test_trainer_naive.py", "test_lora_run.py"):
        assert unit_of(f"tests/trainer/{name}::test_x") == "tests/trainer"
    # the long e2e file uses none of it: a unit of its own
    assert unit_of("tests/trainer/test_trainer_e2e.py::test_x[a]") == (
        "tests/trainer/test_trainer_e2e.py")
    # engines of tests/rollout/conftest.py are session-scoped; tests/launch has no such fixture
    assert unit_of("tests/rollout/test_control.py::test_x") == "tests/rollout"
    assert unit_of("tests/launch/test_launch_local.py::test_x") == "tests/launch/test_launch_local.py"
    assert unit_of("tests/test_cli.py::test_x") == "tests/test_cli.py"


def test_units_run_whole_and_costliest_first():
    ids = ["tests/algo/test_kl.py::a", "tests/trainer/test_resume.py::a",
           "tests/algo/test_kl.py::b", "tests/trainer/test_trainer_naive.py::a",
           "tests/launch/test_launch_local.py::a", "tests/trainer/test_resume.py::b"]
    order = [ids[i] for i in order_by_unit_cost(ids)]
    assert sorted(order) == sorted(ids)
    # tests/trainer (resume + naive) > test_launch_local > an unlisted file; collected order kept
    assert order == ["tests/trainer/test_resume.py::a", "tests/trainer/test_trainer_naive.py::a",
                     "tests/trainer/test_resume.py::b", "tests/launch/test_launch_local.py::a",
                     "tests/algo/test_kl.py::a", "tests/algo/test_kl.py::b"]
    assert FILE_SECONDS["trainer/test_resume.py"] + FILE_SECONDS["trainer/test_trainer_naive.py"] \
        > FILE_SECONDS["launch/test_launch_local.py"]
