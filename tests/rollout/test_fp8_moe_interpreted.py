"""The block-FP8 experts' Triton grouped GEMMs on CPU, through Triton's interpreter
(``TRITON_INTERPRET=1``): the same checks as tests/gpu/test_fp8_moe_gpu.py, in a child process
(the variable must be set before Triton loads) whose path has the Triton that ``make test``
installs beside the venv (``.venv/triton-interpreter``: not in the venv's site-packages, where
every megatron process would pay for importing it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
TRITON = Path(sys.prefix) / "triton-interpreter"


def run_interpreted(code: str) -> str:
    if not (TRITON / "triton").is_dir():
        pytest.skip(f"no Triton for the interpreter at {TRITON} (make test installs it)")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(TRITON), str(TESTS), os.environ.get("PYTHONPATH",
                                                                                   "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_sort_by_expert_groups_every_pair_once():
    run_interpreted("import fp8_moe_checks as c; c.check_sort_by_expert('cpu')")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_gemms_equal_the_expert_by_expert_reference(dtype):
    out = run_interpreted("import torch, fp8_moe_checks as c\n"
                          f"print(c.check_fused_matches_reference('cpu', torch.{dtype}))")
    print(dtype, "largest error / largest output:", out.strip())
