"""The weight sync's export on a model-parallel group of one rank (megarl.megatron.hf_export)
against mbridge's ``export_weights``: the same HF names in the same order and bit-identical
tensors for every architecture the tests build; the plain weights come out as views of the
parameters (no copy, no collective)."""

from __future__ import annotations

import pytest
import torch

from megarl.megatron.parallel import ParallelSizes

ARCHES = ["qwen3", "qwen3_moe", "qwen3_4layers", "qwen2", "qwen2_moe", "mixtral", "llama"]


def both_exports_on_rank(model_dir):
    from megarl.megatron.hf_export import export_hf_weights, one_rank_layout
    from megarl.megatron.model import build_actor_model

    model = build_actor_model(model_dir, ParallelSizes(), torch.float32)
    assert one_rank_layout(model.bridge)
    with torch.no_grad():
        ours = [(n, t.detach().clone(), t.untyped_storage().data_ptr())
                for n, t in export_hf_weights(model)]
        theirs = [(n, t.detach().clone()) for n, t in model.bridge.export_weights(model.chunks)]
    storages = {p.untyped_storage().data_ptr() for c in model.chunks for p in c.parameters()}
    return {
        "names": [n for n, _, _ in ours],
        "reference_names": [n for n, _ in theirs],
        "different": [n for (n, a, _), (_, b) in zip(ours, theirs)
                      if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b)],
        "views": sum(ptr in storages for _, _, ptr in ours),
    }


@pytest.mark.parametrize("name", ARCHES)
def test_one_rank_export_equals_mbridge(pool1, tiny_models, name):
    (r,) = pool1.run(both_exports_on_rank, tiny_models[name])
    assert r["names"] == r["reference_names"] and len(r["names"]) > 10
    assert r["different"] == []
    # norms, embeddings, projections and experts are views; only split q/k/v may be copies
    assert r["views"] >= len(r["names"]) // 2, r["views"]
