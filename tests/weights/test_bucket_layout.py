"""The sender's bucket layouts: packed bytes equal the per-tensor packing's, layouts are reused
only while the plan is unchanged, and a stale plan never packs."""

from __future__ import annotations

import copy

import pytest
import torch

from megarl.weights.bucket_layout import LayoutCache, iter_layouts, pack_layout
from megarl.weights.flattened import flatten_bucket
from megarl.weights.sglang_sender import iter_buckets, plan_buckets


def _export(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """fp32 tensors as an export yields them: projections (one handed out transposed, so not
    contiguous), a norm, an embedding."""
    gen = torch.Generator().manual_seed(seed)
    out = [("model.embed_tokens.weight", torch.randn(32, 16, generator=gen))]
    for layer in range(3):
        prefix = f"model.layers.{layer}"
        out += [(f"{prefix}.self_attn.q_proj.weight", torch.randn(16, 16, generator=gen)),
                (f"{prefix}.self_attn.o_proj.weight", torch.randn(16, 16, generator=gen).t()),
                (f"{prefix}.mlp.gate_proj.weight", torch.randn(40, 16, generator=gen)),
                (f"{prefix}.input_layernorm.weight", torch.randn(16, generator=gen))]
    return out


@pytest.mark.parametrize("dtype,quantization", [("bfloat16", None), ("float32", None),
                                                ("bfloat16", "fp8")])
def test_packed_buckets_equal_the_per_tensor_packing(dtype, quantization):
    """Each bucket's bytes and records equal ``flatten_bucket`` of the tensors cast (or
    quantized) one by one, in buckets small enough that there are several."""
    named = _export()
    plan = plan_buckets([(n, list(t.shape)) for n, t in named], dtype, 0.002, quantization)
    assert len(plan) >= 3
    layouts = LayoutCache().get(plan)
    buffer = torch.full((max(lay.size for lay in layouts),), 7, dtype=torch.uint8)
    expected = list(iter_buckets(iter(named), plan))
    for (layout, tensors), bucket in zip(iter_layouts(iter(named), layouts), expected,
                                         strict=True):
        packed = pack_layout(buffer, layout, tensors)
        reference = flatten_bucket(bucket)
        assert torch.equal(packed["flattened_tensor"], reference["flattened_tensor"])
        assert [vars(m) for m in packed["metadata"]] == [vars(m) for m in reference["metadata"]]


def test_layouts_are_reused_while_the_plan_is_equal_and_rebuilt_when_it_changes():
    named = _export()
    specs = [(n, list(t.shape)) for n, t in named]
    cache = LayoutCache()
    first = cache.get(plan_buckets(specs, "bfloat16", 0.002))
    # an equal plan in new objects (as each sync receives it from the driver): reused
    assert cache.get(copy.deepcopy(plan_buckets(specs, "bfloat16", 0.002))) is first
    assert cache.builds == 1
    # a changed shape, name or dtype: rebuilt, and the new layouts describe the new plan
    specs[1] = (specs[1][0], [8, 16])
    for plan in (plan_buckets(specs, "bfloat16", 0.002),
                 plan_buckets([("x." + n, s) for n, s in specs], "bfloat16", 0.002),
                 plan_buckets(specs, "float32", 0.002)):
        layouts = cache.get(plan)
        assert [[(m.name, list(m.shape), m.dtype) for m in lay.metadata] for lay in layouts] \
            == [[(n, s, getattr(torch, d)) for n, s, d in b] for b in plan]
    assert cache.builds == 4


def test_a_stale_plan_raises_before_packing():
    named = _export()
    plan = plan_buckets([(n, list(t.shape)) for n, t in named], "bfloat16", 0.002)
    layouts = LayoutCache().get(plan)
    changed = list(named)
    changed[2] = (changed[2][0], torch.zeros(8, 16))
    with pytest.raises(RuntimeError, match="the plan is stale"):
        list(iter_layouts(iter(changed), layouts))
    with pytest.raises(RuntimeError, match="after the last planned tensor"):
        list(iter_layouts(iter(named + [("extra.weight", torch.zeros(2))]), layouts))
