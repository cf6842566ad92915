"""Host memory per node (megarl/config/host_estimates.py): the MoE shape of benchmarks/e2e_step.py
against a formula written out by hand, the tiny demo, the placement of pools on a node, and the
fields its fix advice names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megarl.config import derive_sizes, load_config, load_model_info
from megarl.config.estimates import GB, estimate, stage_params
from megarl.config.host_estimates import (
    ENGINE_PROCESS_BYTES,
    NODE_BYTES,
    TRAIN_PROCESS_BYTES,
    host_estimate,
    host_fixes,
    host_rows,
    pinned,
    stage_tensors,
)
from megarl.config.loader import schema_fields
from megarl.config.model_info import model_info_from_dict
from megarl.config.schema import ParallelConfig

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20


@pytest.fixture(scope="module")
def moe_shape():
    """benchmarks/e2e_step.py's ``moe`` shape: a 5.6B slice of Qwen3-30B-A3B (8 layers)."""
    from benchmarks.e2e_step import SHAPES

    dims = dict(SHAPES["moe"])
    return model_info_from_dict({"model_type": dims.pop("arch"), **dims})


def e2e_config(*overrides: str):
    """The benchmark's megarl config on the H200 (moe-gpu-demo.yaml, its defaults: 64 prompts
    x 8, 16k-token micro-batches, full recompute, one GPU, colocated embedded engine)."""
    cfg, _ = load_config(REPO / "configs" / "moe-gpu-demo.yaml", [
        "model.path=unused", "data.train_batch_size=64", "rollout.n=8",
        "actor.ppo_mini_batch_size=64", "actor.recompute.granularity=full",
        "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=16384",
        "data.max_prompt_length=512", "data.max_response_length=2048", "actor.parallel.ep=1",
        "resources.train_pool.gpus_per_node=1", "resources.gpu_memory_gb=139.8", *overrides])
    return cfg


def test_pinned_buffers_round_up_to_a_power_of_two():
    assert [pinned(n) for n in (0, 1, 3, 4096, 12 * MIB, 16 * MIB + 1)] == [
        0, 1, 4, 4096, 16 * MIB, 32 * MIB]


def test_the_moe_e2e_shape_holds_its_optimizer_and_only_an_adapter_sync_keeps_engine_weights(
        moe_shape):
    """The H200 run that lost its node in step 3: by hand, the optimizer's fp32 main params and
    two moments (12 B per parameter, one GPU) packed in 1 GiB slabs plus one of the next power of
    two of the rest; grads (freed, never copied) add nothing; the colocated engine drops its
    released weights (the sync refills them). With the LoRA adapter sync, which never resends
    the base, the engine keeps them: the embedded engine's bf16 weights, each tensor pinned in
    a buffer rounded up to a power of two; SGLang's without the round-up."""
    cfg = e2e_config()
    assert cfg.actor.offload.grad_offload and cfg.actor.offload.optimizer_offload
    params = moe_shape.param_count()
    assert params == pytest.approx(5.6e9, rel=0.01)
    h, layers, experts, vocab = 2048, 8, 128, 151936
    tensors = ([(h * 128 * (32 + 2 * 4), layers), (32 * 128 * h, layers), (experts * h, layers),
                (2 * 768 * h, layers * experts), (768 * h, layers * experts), (vocab * h, 2)])
    assert sum(n * c for n, c in tensors) == params
    engine_round_up = sum(c * (pinned(2 * n) - 2 * n) for n, c in tensors)

    optimizer = 12 * params
    slabs = -(-optimizer // 2**30)  # the last slab: the next power of two of the rest
    rest = optimizer - (slabs - 1) * 2**30
    last = 1 << (rest - 1).bit_length()
    processes = TRAIN_PROCESS_BYTES + ENGINE_PROCESS_BYTES + NODE_BYTES
    by_hand = (slabs - 1) * 2**30 + last + processes
    sizes = derive_sizes(cfg, moe_shape)
    est = estimate(cfg, moe_shape, sizes)
    node = host_estimate(cfg, moe_shape, sizes, est).on_node()
    parts = {p.name: p for p in node.parts}
    assert node.total == by_hand > 70 * GB
    assert parts["actor optimizer"].nbytes == est.update.state.optimizer == optimizer
    assert parts["actor optimizer"].round_up == last - rest < 2**30
    assert set(parts) == {"actor optimizer", "processes"}  # no grads, no engine weights
    for backend, round_up in (("local", engine_round_up), ("sglang", 0)):
        adapter = e2e_config("actor.lora.rank=32", "actor.lora.sync=adapter",
                             f"rollout.backend={backend}")
        est = estimate(adapter, moe_shape, derive_sizes(adapter, moe_shape))
        parts = {p.name: p for p in host_estimate(adapter, moe_shape, derive_sizes(
            adapter, moe_shape), est).on_node().parts}
        assert parts["engine weights"].nbytes == est.engine.weights == 2 * params, backend
        assert parts["engine weights"].round_up == round_up, backend
    assert engine_round_up > 3 * GB  # 12 MiB -> 16 MiB...


def test_param_offload_adds_the_weights_in_slabs_and_the_demo_is_small(moe_shape, tiny_moe_dir):
    """param_offload adds the weights, in slabs as the optimizer state; the tiny demo on a GPU
    needs little beyond its processes."""
    cfg = e2e_config("actor.offload.param_offload=true")
    sizes = derive_sizes(cfg, moe_shape)
    st = estimate(cfg, moe_shape, sizes).update.state
    params = {p.name: p for p in host_estimate(cfg, moe_shape, sizes).on_node().parts}
    weights = params["actor params"]
    assert weights.nbytes == st.weights == 2 * (st.dense_params + st.expert_params)
    rest = st.weights % 2**30
    assert weights.round_up == pinned(rest) - rest

    demo, _ = load_config(REPO / "configs" / "tiny-moe-cpu.yaml", [
        f"model.path={tiny_moe_dir}", "resources.device=cuda", "rollout.colocate=true",
        "resources.rollout_pool=null"])
    model = load_model_info(tiny_moe_dir)
    node = host_estimate(demo, model, derive_sizes(demo, model)).on_node()
    beyond = [p for p in node.parts if p.name != "processes"]
    assert beyond and sum(p.total for p in beyond) < 4 * MIB
    assert node.total < 2 * (TRAIN_PROCESS_BYTES + ENGINE_PROCESS_BYTES) + NODE_BYTES + 4 * MIB
    cpu, _ = load_config(REPO / "configs" / "tiny-moe-cpu.yaml", [f"model.path={tiny_moe_dir}"])
    assert host_rows(cpu, model, derive_sizes(cpu, model)) == [("host memory", (
        "CPU run: the roles' state is host memory (the rows above); offload moves nothing"))]


@pytest.mark.parametrize("card", ["qwen3-30b-a3b", "deepseek-v3-671b", "qwen3-8b"])
def test_the_tensors_add_up_to_the_gpu_estimates_parameters(card):
    model = load_model_info(REPO / "configs" / "models" / card)
    for p in (ParallelConfig(), ParallelConfig(tp=4, pp=4, ep=8 if model.is_moe else 1)):
        for stage in range(p.pp):
            dense, expert = stage_tensors(model, p, stage, model.vocab_size)
            want_dense, want_expert = stage_params(model, p, stage, model.vocab_size)
            assert sum(n * c for n, c in expert) == want_expert
            got = sum(n * c for n, c in dense)  # each tensor's split over tp rounds up
            assert want_dense <= got <= want_dense + sum(c for _, c in dense)


def test_a_node_holds_what_the_pools_can_place_on_it(moe_shape):
    """Separate pools on an 8-GPU node of 4 train + 4 rollout GPUs: the node takes both."""
    cfg = e2e_config("rollout.colocate=false", "resources.train_pool.gpus_per_node=4",
                     "resources.rollout_pool.nnodes=1", "resources.rollout_pool.gpus_per_node=4",
                     "actor.offload.optimizer_offload=true", "checkpoint_engine.backend=nccl")
    host = host_estimate(cfg, moe_shape, derive_sizes(cfg, moe_shape))
    both, train_only = host.on_node(8), host.on_node(4)
    assert (both.train_gpus, both.rollout_gpus) == (4, 4)
    assert (train_only.train_gpus, train_only.rollout_gpus) == (4, 0)
    assert both.total == train_only.total + 4 * ENGINE_PROCESS_BYTES
    assert host.on_node(2).total == 0  # no pool's node fits: nothing is placed there
    assert train_only.total == host.on_node().total


def _named_fields(text: str) -> list[tuple[str, str | None]]:
    """(field, value or None) of every dotted config path a message names."""
    return [(m[1], m[4]) for m in re.finditer(r"\b([a-z_]+(\.[a-z_]+)+)(=([^\s,;)]+))?", text)]


def test_every_field_the_fix_names_exists_and_takes_its_value(moe_shape):
    """The advice for a node of too little memory names real fields with valid values, and only
    offers an offload switch off where the GPU phases still fit."""
    cfg = e2e_config("actor.offload.param_offload=true", "trainer.async_save=true",
                     "resources.train_pool.gpus_per_node=8",
                     "actor.use_distributed_optimizer=false")
    sizes = derive_sizes(cfg, moe_shape)
    host = host_estimate(cfg, moe_shape, sizes)
    node = host.on_node()
    # 120 GB free: with the optimizer on the GPU only generation would not fit (~124 GB), and
    # a lower memory fraction for the engine makes it
    fixes = host_fixes(cfg, moe_shape, sizes, host, node, node.total * 9 // 10, 120 * GB)
    text = "; ".join(fixes)
    for fix in ("actor.offload.optimizer_offload=false with rollout.gpu_memory_utilization=",
                "actor.offload.param_offload=false",
                "actor.use_distributed_optimizer=true", "resources.train_pool.gpus_per_node=7"):
        assert fix in text, fix
    adapter = e2e_config("actor.lora.rank=32", "actor.lora.sync=adapter",
                         "resources.train_pool.gpus_per_node=8")
    a_sizes = derive_sizes(adapter, moe_shape)
    a_host = host_estimate(adapter, moe_shape, a_sizes)
    a_node = a_host.on_node()
    merged = "; ".join(host_fixes(adapter, moe_shape, a_sizes, a_host, a_node,
                                  a_node.total * 9 // 10, 120 * GB))
    assert "actor.lora.sync=merged (the engines then drop released weights" in merged, merged
    assert "lora.sync" not in text
    named = _named_fields(text + "; " + merged)
    assert len(named) >= 6
    known = schema_fields()
    for field, value in named:
        assert field in known, field
        if value is not None:
            load_config(REPO / "configs" / "moe-gpu-demo.yaml", [f"{field}={value}"])
    # a GPU with no room left: no offload switch is offered; nor a part that frees too little
    tight = host_fixes(cfg, moe_shape, sizes, host, node, node.total * 9 // 10, 20 * GB)
    assert not any(".offload." in fix for fix in tight)
    short = host_fixes(cfg, moe_shape, sizes, host, node, node.total // 3, int(139.8 * GB))
    assert "optimizer_offload" in "; ".join(short)
