"""The block-FP8 experts' Triton grouped GEMMs on CPU, through Triton's interpreter
(``TRITON_INTERPRET=1``): the same checks as tests/gpu/test_fp8_moe_gpu.py, and the probe a CUDA
engine runs at load. They run in one child process (the variable must be set before Triton
loads) whose path has the Triton that ``make test`` installs beside the venv
(``.venv/triton-interpreter``: not in the venv's site-packages, where every megatron process
would pay for importing it); each test reads its part of the child's report."""

from __future__ import annotations

import pytest

from tests.rollout.interpreted import result, run_child

CHILD = """
import torch
import fp8_moe_checks as c
from megarl.rollout.local import fp8_layers as f, fp8_moe_triton as t

def probe(patch):
    original = t.fp8_moe
    if patch == "failing":
        def boom(*args):
            raise RuntimeError("no kernel image")
        t.fp8_moe = boom
    elif patch == "wrong":
        t.fp8_moe = lambda x, *args: torch.zeros_like(x)
    f._Experts.fused = None
    try:
        f._probe_experts(torch.device("cpu"))
    finally:
        t.fp8_moe = original
    return [f._Experts.fused, f._Experts.reason]

part("sort", lambda: c.check_sort_by_expert("cpu"))
part("quantize", lambda: c.check_quantize_activations("cpu", exact=True))
part("linear", lambda: c.check_linear_triton("cpu", exact=True))
part("float32", lambda: c.check_fused_matches_reference("cpu", torch.float32))
part("bfloat16", lambda: c.check_fused_matches_reference("cpu", torch.bfloat16))
for patch in ("none", "failing", "wrong"):
    part("probe_" + patch, lambda: probe(patch))
"""


@pytest.fixture(scope="module")
def report() -> dict:
    return run_child(CHILD)


def test_sort_by_expert_groups_every_pair_once(report):
    result(report, "sort")


def test_the_activation_quantization_kernel_is_the_torch_ops(report):
    result(report, "quantize")


def test_the_one_launch_w8a8_linear_is_the_reference_product(report):
    print("largest error:", result(report, "linear"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_gemms_equal_the_expert_by_expert_reference(report, dtype):
    print(dtype, "largest error:", result(report, dtype))


def test_the_engine_probes_the_kernels_and_falls_back_with_the_reason(report):
    """What a CUDA engine does at load, here on CPU tensors: the grouped GEMMs agree with the
    reference and are used; a kernel that fails, or that gives other numbers, leaves the
    experts on the reference, and the reason is what ``/get_server_info`` reports."""
    assert result(report, "probe_none") == [True, "Triton grouped GEMMs (fp8_moe_triton)"]
    assert result(report, "probe_failing") == [
        False, "reference (the grouped GEMMs failed: no kernel image)"]
    assert result(report, "probe_wrong") == [
        False, "reference (the grouped GEMMs differ from it by 1 relative in torch.float32)"]
