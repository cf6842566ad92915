"""The embedded engine sizes its KV pool as SGLang does (``ModelRunner.profile_max_num_token``
of sglang 0.5.10, its own source run here): what is free after the weights loaded, less
``1 - mem_fraction_static`` of what was free before they did. Memory another process holds (a
colocated actor's parameters) is never the engine's; on the H100 the earlier rule (weights + KV
= fraction of the whole GPU) left a dense e2e run's engine 181 MB for its activations and it ran
out of memory in a generation step."""

from __future__ import annotations

import types

import pytest
import sglang_ref

from megarl.rollout.local.kv_cache import kv_slots

GIB = 2**30
MIXIN = "srt/model_executor/model_runner_kv_cache_mixin.py"


def sglang_pool_size(free_before_gib: float, free_after_gib: float, fraction: float,
                     cell_size: int) -> int:
    """SGLang's ``profile_max_num_token`` on a one-GPU runner whose free memory reads
    ``free_after_gib`` (SGLang's ``get_available_gpu_memory`` answers in GiB)."""
    def available(device, gpu_id, distributed=False, cpu_group=None):
        return free_after_gib

    world = types.SimpleNamespace(world_size=1, cpu_group=None)
    mixin = sglang_ref.load_definitions(MIXIN, ["ModelRunnerKVCacheMixin"], {
        "ModelRunner": object, "get_available_gpu_memory": available,
        "get_world_group": lambda: world, "Optional": object, "Tuple": object,
    })["ModelRunnerKVCacheMixin"]
    runner = types.SimpleNamespace(device="cuda", gpu_id=0, is_draft_worker=False,
                                   mambaish_config=None, num_effective_layers=28,
                                   mem_fraction_static=fraction,
                                   get_cell_size_per_token=lambda num_layers: cell_size)
    return mixin.profile_max_num_token(runner, free_before_gib)


@pytest.mark.parametrize("before, after, fraction", [
    (78.5, 75.1, 0.8),   # a free H100, the dense shape's 3.4 GiB of weights
    (72.6, 69.2, 0.8),   # the same with a colocated actor holding 5.3 GiB and 0.7 GiB elsewhere
    (139.0, 128.6, 0.85),  # an H200 and the MoE slice's 10.4 GiB
    (20.0, 16.5, 0.5),
])
def test_the_kv_pool_is_sized_as_sglang_sizes_it(before, after, fraction):
    cell = 28 * 2 * 8 * 128 * 2  # Qwen3-1.7B's layers x (k, v) x kv heads x head_dim x bf16
    ours = kv_slots(int(before * GIB), int(after * GIB), fraction, cell)
    assert abs(ours - sglang_pool_size(before, after, fraction, cell)) <= 1  # float rounding
    # the headroom left free is (1 - fraction) of what was free before the load
    assert (after * GIB - ours * cell) == pytest.approx(before * GIB * (1 - fraction),
                                                        abs=cell)


def test_a_colocated_process_shrinks_the_pool_by_what_it_holds():
    """5.3 GiB held by another process before the engine loads: the pool shrinks by 0.8 of it,
    the activations' headroom by 0.2 of it (the earlier rule kept the pool and let the
    headroom pay the whole 5.3 GiB)."""
    cell = 114688
    alone = kv_slots(int(78.5 * GIB), int(75.1 * GIB), 0.8, cell)
    shared = kv_slots(int(73.2 * GIB), int(69.8 * GIB), 0.8, cell)
    assert (alone - shared) * cell == pytest.approx(0.8 * 5.3 * GIB, rel=1e-3)
