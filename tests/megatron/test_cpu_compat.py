"""The CPU compatibility layer, exercised in a worker process (its patches are process-wide)."""

from __future__ import annotations

import threading

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is off with CUDA")


def compat_touchpoints() -> dict:
    """Run on a rank: enable the layer and hit each touchpoint; report what happened."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.utils import get_default_causal_mask

    from megarl.megatron import cpu_compat
    from megarl.megatron.parallel import ParallelSizes, init_parallel

    report = {"first": cpu_compat.enable(), "second": cpu_compat.enable()}
    init_parallel(ParallelSizes(), seed=7)
    report["current_device"] = torch.cuda.current_device()
    report["factory_devices"] = [
        torch.zeros(2, device="cuda").device.type,
        torch.tensor([1.0], device=torch.device("cuda", 0)).device.type,
        torch.ones(2).cuda().device.type,
        torch.ones(2).to("cuda").device.type,
        torch.empty(1, pin_memory=True).device.type,
        get_default_causal_mask(4).device.type,
    ]
    # the optimizer's parameter-type checks
    report["type_names"] = [torch.ones(1).type(), torch.ones(1, dtype=torch.bfloat16).type()]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.current_stream())
    event = stream.record_event()
    event.synchronize()
    torch.cuda.synchronize()
    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 4]), as_numpy=True)
    report["splits"] = [type(splits).__module__, splits.tolist()]

    # the tracker's stream is separate from, and does not disturb, the default generator
    state = torch.get_rng_state()
    plain = torch.rand(4)
    torch.set_rng_state(state)
    with get_cuda_rng_tracker().fork():
        forked_a = torch.rand(4)
    after_fork = torch.rand(4)
    with get_cuda_rng_tracker().fork():
        forked_b = torch.rand(4)
    report["default_stream_unchanged"] = torch.equal(plain, after_fork)
    report["tracker_differs"] = not torch.equal(forked_a, plain)
    report["tracker_advances"] = not torch.equal(forked_a, forked_b)

    # the device mode is per thread: a new thread needs its own enable()
    outcome = {}

    def other_thread() -> None:
        try:
            torch.zeros(1, device="cuda")
            outcome["before"] = "ok"
        except (RuntimeError, AssertionError) as exc:
            outcome["before"] = type(exc).__name__
        cpu_compat.enable()
        outcome["after"] = torch.zeros(1, device="cuda").device.type

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    report["thread"] = outcome
    return report


def test_touchpoints(pool1):
    (report,) = pool1.run(compat_touchpoints)
    assert report["first"] is True and report["second"] is True
    assert report["current_device"] == "cpu"
    assert report["factory_devices"] == ["cpu"] * 6
    assert report["type_names"] == ["torch.cuda.FloatTensor", "torch.cuda.BFloat16Tensor"]
    assert report["splits"] == ["numpy", [3, 4]]
    assert report["default_stream_unchanged"]
    assert report["tracker_differs"] and report["tracker_advances"]
    assert report["thread"]["before"] != "ok"
    assert report["thread"]["after"] == "cpu"


def rng_tracker_per_tp_rank() -> list[float]:
    """Run on a rank: the model-parallel RNG stream differs between TP ranks (megatron's
    per-rank seed offset), the default stream does not."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megarl.megatron.parallel import ParallelSizes, init_parallel

    init_parallel(ParallelSizes(tp=2), seed=11)
    default = torch.rand(1).item()
    with get_cuda_rng_tracker().fork():
        model_parallel = torch.rand(1).item()
    return [default, model_parallel]


def test_rng_tracker_seeds_per_tp_rank(pool2):
    rank0, rank1 = pool2.run(rng_tracker_per_tp_rank)
    assert rank0[0] == rank1[0]
    assert rank0[1] != rank1[1]


FUSIONS_PROBE = """
import sys
{before}
import megarl.megatron
from megatron.core import jit
from megatron.core.fusions import fused_bias_swiglu
from megatron.core.transformer.moe.router import TopKRouter
print(jit.jit_fuser is jit.noop_decorator,
      type(fused_bias_swiglu.swiglu).__name__,
      type(TopKRouter.__dict__["_apply_expert_bias"]).__name__,
      "torch._inductor.compile_fx" in sys.modules)
"""


@pytest.mark.parametrize("before, expected", [
    # megarl.megatron first (every megarl process): the fusions are plain functions, Inductor's
    # compiler is never imported
    ("", "True function function False"),
    # megatron-core imported before megarl: torch.compile wrapped them, and megarl leaves them
    ("import megatron.core", "False"),
])
def test_megatrons_fusions_run_eagerly_without_cuda(before, expected):
    """Without CUDA, megatron's ``jit_fuser`` (``torch.compile``) is disabled before any fusion
    binds it: ~1 s of CPU per process for Dynamo and Inductor's imports and compile machinery,
    for functions that compile to nothing on a CPU. A fresh interpreter: the hook acts once."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-W", "ignore", "-c",
                          FUSIONS_PROBE.format(before=before)],
                         capture_output=True, text=True, check=True, timeout=120).stdout.split()
    assert " ".join(out[:len(expected.split())]) == expected, out
