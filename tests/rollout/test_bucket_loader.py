"""The engine's planned load of ``flattened_bucket`` payloads writes what the per-tensor load
writes, bit for bit, reuses a bucket's plan only while its records are equal, and keeps nothing
that holds a parameter's memory."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.local.bucket_loader import BucketLoader, bucket_records
from megarl.rollout.local.weights import WeightMap, iter_safetensors
from megarl.weights.flattened import flatten_bucket, unflatten, view_payload


def _model(path, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def _state(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _fresh(checkpoint, seed: int, dtype=None) -> list[tuple[str, torch.Tensor]]:
    """New values for every checkpoint tensor (in ``dtype``, default its own), shuffled."""
    gen = torch.Generator().manual_seed(seed)
    named = [(n, torch.randn(t.shape, generator=gen).to(dtype or t.dtype)) for n, t in checkpoint]
    random.Random(seed).shuffle(named)
    return named


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("loader") / "m", arch="qwen3_moe",
                           with_tokenizer=False)


def _load_both(path, payloads, dtype=torch.float32):
    """The models after loading ``payloads`` through the loader and through ``load_many``."""
    planned, reference = _model(path, dtype), _model(path, dtype)
    loader, weights = BucketLoader(WeightMap(planned)), WeightMap(reference)
    for payload in payloads:
        assert loader.load(bucket_records(payload["metadata"]), payload) == len(
            payload["metadata"])
        weights.load_many(unflatten(payload))
    return planned, reference, loader


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen3"])
def test_a_planned_load_writes_what_the_per_tensor_load_writes(arch, tmp_path):
    """Every checkpoint tensor in shuffled order, sent in bf16 and in fp32 to a bf16 model
    (the copy casts): both loads leave every live tensor equal, bit for bit, and equal to
    the values sent."""
    path = make_tiny_model(tmp_path / arch, arch=arch, with_tokenizer=False)
    checkpoint = list(iter_safetensors(path))
    for dtype in (torch.bfloat16, torch.float32):
        named = _fresh(checkpoint, seed=1, dtype=dtype)
        planned, reference, _ = _load_both(path, [flatten_bucket(named)], torch.bfloat16)
        assert {n: torch.equal(t, _state(reference)[n]) for n, t in _state(planned).items()} \
            == dict.fromkeys(_state(planned), True)
        view = WeightMap(planned).view
        for name, tensor in named:
            assert torch.equal(view(name), tensor.to(torch.bfloat16)), name


def test_a_plan_is_reused_while_the_records_are_equal_and_made_again_when_they_change(moe_path):
    checkpoint = list(iter_safetensors(moe_path))
    model = _model(moe_path)
    loader = BucketLoader(WeightMap(model))
    view = loader.weights.view
    for seed in (1, 2):  # same names, shapes and order: new values, one plan
        named = sorted(_fresh(checkpoint, seed))
        payload = flatten_bucket(named)
        loader.load(bucket_records(payload["metadata"]), payload)
        assert loader.planned == 1
        assert all(torch.equal(view(n), t) for n, t in named)
    # another order moves every record: a new plan, and the values land where they belong
    named = _fresh(checkpoint, seed=3)
    payload = flatten_bucket(named)
    loader.load(bucket_records(payload["metadata"]), payload)
    assert loader.planned == 2
    assert all(torch.equal(view(n), t) for n, t in named)
    # a record whose shape changed is refused before anything is written
    before = _state(model)
    named = _fresh(checkpoint, seed=4)
    named[0] = (named[0][0], named[0][1].reshape(-1)[:-1].clone())
    payload = flatten_bucket(named)
    with pytest.raises(ValueError, match="shape"):
        loader.load(bucket_records(payload["metadata"]), payload)
    with pytest.raises(ValueError, match="1 unknown weight names"):
        payload = flatten_bucket([("model.layers.9.mlp.gate.weight", torch.zeros(2))])
        loader.load(bucket_records(payload["metadata"]), payload)
    assert all(torch.equal(t, before[n]) for n, t in _state(model).items())


def test_views_of_one_storage_with_gaps_between_them_load_exactly(moe_path):
    """A zero-copy payload: the flat tensor views one storage holding the tensors in reverse
    order with a gap after each; the records point into it."""
    named = _fresh(list(iter_safetensors(moe_path)), seed=5)
    storage = torch.zeros(sum(t.numel() + 3 for _, t in named))
    views, end = [], storage.numel()
    for name, tensor in named:
        end -= tensor.numel() + 3
        views.append((name, storage[end:end + tensor.numel()].view(tensor.shape)))
        views[-1][1].copy_(tensor)
    planned, reference, loader = _load_both(moe_path, [view_payload(views)])
    assert loader.planned == 1
    reference_state = _state(reference)
    assert all(torch.equal(t, reference_state[n]) for n, t in _state(planned).items())
    assert all(torch.equal(loader.weights.view(n), t) for n, t in named)


def test_tied_weights_sent_under_both_names_load_in_order(tmp_path):
    path = make_tiny_model(tmp_path / "tied", arch="qwen3", with_tokenizer=False,
                           tie_word_embeddings=True)
    shape = dict(iter_safetensors(path))["model.embed_tokens.weight"].shape
    named = [("model.embed_tokens.weight", torch.ones(shape)),
             ("lm_head.weight", torch.full(shape, 2.0))]
    planned, reference, loader = _load_both(path, [flatten_bucket(named)])
    assert loader.plan(bucket_records(flatten_bucket(named)["metadata"])).ordered
    assert torch.equal(planned.get_input_embeddings().weight, torch.full(shape, 2.0))
    assert torch.equal(reference.get_input_embeddings().weight, torch.full(shape, 2.0))


def test_the_plan_holds_no_tensor_and_follows_replaced_parameters(moe_path, monkeypatch):
    """A released engine frees its weights by replacing each parameter's data: a plan that
    held views would keep the old memory alive and write into it. The plan holds numbers
    only, writes into the parameters' new data, and leaves a parameter whose size changed
    (released: empty) to the per-tensor load."""
    model = _model(moe_path)
    loader = BucketLoader(WeightMap(model))
    named = _fresh(list(iter_safetensors(moe_path)), seed=6)
    payload = flatten_bucket(named)
    records = bucket_records(payload["metadata"])
    loader.load(records, payload)

    def leaves(obj):
        if dataclasses.is_dataclass(obj):
            obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
        if isinstance(obj, (list, tuple)):
            for item in obj:
                yield from leaves(item)
        else:
            yield obj

    assert not any(isinstance(leaf, torch.Tensor) for leaf in leaves(loader.plan(records)))
    fused = dict(model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
    old = fused.data
    kept = old.clone()
    fused.data = torch.zeros_like(old)  # resumed: new memory
    named = [(n, t + 1) for n, t in named]
    payload = flatten_bucket(named)
    loader.load(bucket_records(payload["metadata"]), payload)
    assert loader.planned == 1  # the same records: the same plan
    assert all(torch.equal(loader.weights.view(n), t) for n, t in named)
    assert torch.equal(old, kept)  # the released memory was not written
    fused.data = torch.empty(0)  # released: the per-tensor load decides
    calls = []
    monkeypatch.setattr(loader.weights, "load_many", lambda items: calls.append(items) or 0)
    loader.load(bucket_records(payload["metadata"]), payload)
    assert len(calls) == 1


def test_a_parameter_and_a_view_of_it_in_one_bucket_load_in_order(moe_path):
    """The fused experts by their own name, then one expert's half: the later write wins, as
    in the per-tensor load."""
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    shape = dict(_model(moe_path).named_parameters())[fused].shape
    named = [(fused, torch.ones(shape)),
             ("model.layers.0.mlp.experts.1.up_proj.weight", torch.full((shape[1] // 2,
                                                                         shape[2]), 2.0))]
    planned, reference, loader = _load_both(moe_path, [flatten_bucket(named)])
    assert loader.plan(bucket_records(flatten_bucket(named)["metadata"])).ordered
    written = dict(planned.named_parameters())[fused]
    assert torch.equal(written, dict(reference.named_parameters())[fused])
    assert written.sum() == written.numel() + shape[1] // 2 * shape[2]
