"""LoRA on the actor: one update against the same update of HF ``peft`` on the HF model.

Both sides start from the same adapters (PEFT-named tensors with B away from zero: at PEFT's
B = 0 the A matrices get no gradient and half of the update would go untested), take one PPO
step on the same batch (test_update's loss) and must agree on the adapters after the step, the
log-probs of the stepped model, the loss terms and the gradient norm; the merged export must
equal ``merge_and_unload()``. Tensor parallelism (with and without sequence parallelism) and the
distributed optimizer must give the same step as one rank.
"""

from __future__ import annotations

import pytest
import torch
from test_update import (
    ADAM_EPS,
    ADAM_LR,
    CLIP_C,
    CLIP_HIGH,
    CLIP_LOW,
    ENTROPY_COEFF,
    KL_COEF,
    adam_first_step_bound,
    hf_log_probs,
    make_batch,
    reference_loss_terms,
)

from megarl.megatron.parallel import ParallelSizes

RANK, ALPHA = 4, 8.0
MEGATRON_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SGD_LR = 0.5
ATOL = 2e-5  # fp32: the same sums in other orders (TP shards, packed micro-batches)


def peft_model(model_dir: str, state: dict[str, torch.Tensor] | None = None,
               hf_targets: list[str] = HF_TARGETS, hf_params: list[str] | None = None):
    """The HF model (fp32) with PEFT LoRA adapters on every linear layer of its blocks (and on
    the 3-D expert parameters ``hf_params``, PEFT's ``target_parameters``)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=hf_targets,
                        target_parameters=hf_params)
    model = get_peft_model(hf, config)
    if state is not None:
        result = set_peft_model_state_dict(model, state)
        assert not result.unexpected_keys, result.unexpected_keys
    return model


def initial_adapters(model_dir: str, hf_targets: list[str] = HF_TARGETS,
                     hf_params: list[str] | None = None) -> dict[str, torch.Tensor]:
    """PEFT-named adapters, A and B random (seeded)."""
    from peft import get_peft_model_state_dict

    g = torch.Generator().manual_seed(7)
    shapes = get_peft_model_state_dict(peft_model(model_dir, hf_targets=hf_targets,
                                                  hf_params=hf_params))
    return {name: 0.1 * torch.randn(t.shape, generator=g) for name, t in shapes.items()}


def peft_reference_step(model_dir: str, batch: list[dict], state: dict, optimizer: str,
                        hf_targets: list[str] = HF_TARGETS,
                        hf_params: list[str] | None = None) -> dict:
    """One step of the PEFT model: adapters after it, log-probs of the stepped model, loss
    terms, gradient norm and the merged HF weights (``merge_and_unload``)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    model = peft_model(model_dir, state, hf_targets, hf_params)
    pg, ent, kl = reference_loss_terms(model, batch)
    (pg - ENTROPY_COEFF * ent + KL_COEF * kl).backward()
    named = {n.replace(".default", ""): p for n, p in model.named_parameters() if p.requires_grad}
    assert set(named) == set(state)  # only the adapters train
    params = list(named.values())
    grad_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in params)).item()
    grads = {n: p.grad.detach().clone() for n, p in named.items()}
    if optimizer == "sgd":
        torch.optim.SGD(params, lr=SGD_LR).step()
    else:
        torch.optim.AdamW(params, lr=ADAM_LR, eps=ADAM_EPS, weight_decay=0.0).step()
    with torch.no_grad():
        log_probs = [hf_log_probs(model, s["tokens"]) for s in batch]
    adapters = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    # under checkpoint names (HF fuses the experts in memory and splits them on save)
    out = f"{model_dir}.peft_merged_{optimizer}"
    model.merge_and_unload().save_pretrained(out)
    # (PEFT's expert adapters merge into HF's fused expert tensors, split again on save)
    merged = load_file(f"{out}/model.safetensors")
    return {"adapters": adapters, "log_probs": log_probs, "pg_loss": pg.item(),
            "entropy": ent.item(), "kl_loss": kl.item(), "grad_norm": grad_norm,
            "merged": merged, "grads": grads}


def lora_update_on_rank(model_dir, sizes, batch, state, optimizer="sgd", budget=None,
                        dp_split=False, dtype=torch.float32, targets=MEGATRON_TARGETS):
    """Run on each rank: LoRA adapters set to ``state``, one train_step; returns the metrics,
    the adapters after the step (PEFT names, whole), the stepped model's log-probs, the merged
    export (rank 0) and what megatron's DDP and optimizer hold."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megarl.megatron.logprobs import compute_log_probs
    from megarl.megatron.lora import (
        adapters,
        apply_lora,
        export_merged_weights,
        load_peft_state_dict,
        peft_state_dict,
    )
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.optimizer import OptimizerSettings, TrainableActor
    from megarl.megatron.settings import LoraSettings
    from megarl.megatron.update import LossSettings, TrainSequence, train_step

    model = build_actor_model(model_dir, sizes, dtype, spec="native")
    apply_lora(model, LoraSettings(rank=RANK, alpha=ALPHA, target_modules=targets))
    load_peft_state_dict(model, state)
    actor = TrainableActor(model, OptimizerSettings(
        lr=SGD_LR if optimizer == "sgd" else ADAM_LR, weight_decay=0.0, grad_clip=0.0,
        optimizer=optimizer, use_distributed_optimizer=optimizer == "adam"))
    lora_params = {id(p) for a in adapters(model).values() for p in a.parameters()}
    base = [p for c in model.chunks for p in c.parameters() if id(p) not in lora_params]
    held = {
        "trainable": sum(p.requires_grad for c in model.chunks for p in c.parameters()),
        "adapter_params": len(lora_params),
        "base_with_grad_buffer": sum(hasattr(p, "main_grad") or p.requires_grad for p in base),
        "optimized": sum(len(g["params"]) for g in actor.optimizer.param_groups),
        "master_dtypes": sorted({str(p.dtype) for g in actor.optimizer.param_groups
                                 for p in g["params"]}),
    }
    if dp_split:
        batch = batch[mpu.get_data_parallel_rank() :: mpu.get_data_parallel_world_size()]
    settings = LossSettings(clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH,
                            clip_ratio_c=CLIP_C, entropy_coeff=ENTROPY_COEFF, use_kl_loss=True,
                            kl_loss_coef=KL_COEF, kl_loss_type="low_var_kl")
    metrics = train_step(actor, [TrainSequence(**s) for s in batch], settings,
                         max_tokens_per_micro_batch=budget)
    after = {}
    stages = [None] * mpu.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, peft_state_dict(model),
                           group=mpu.get_pipeline_model_parallel_group())
    for stage in stages:  # each pipeline stage holds the adapters of its layers
        after.update(stage)
    log_probs = compute_log_probs(model, [s["tokens"] for s in batch]).log_probs
    merged = {name: t.detach().clone() for name, t in export_merged_weights(model)}
    first = dist.get_rank() == 0
    return metrics, held, after if first else None, log_probs, merged if first else None


@pytest.fixture(scope="module")
def batch(tiny_models) -> list[dict]:
    return make_batch(tiny_models["qwen3"])


@pytest.fixture(scope="module")
def start(tiny_models) -> dict[str, torch.Tensor]:
    return initial_adapters(tiny_models["qwen3"])


@pytest.fixture(scope="module")
def sgd_reference(tiny_models, batch, start) -> dict:
    return peft_reference_step(tiny_models["qwen3"], batch, start, "sgd")


def assert_same_lora_update(results, reference, start, atol=ATOL) -> None:
    """Rank 0's adapters and merged weights and every rank's log-probs and metrics equal the
    PEFT step's; only the adapters train."""
    metrics, held, after, _, merged = results[0]
    assert held["trainable"] == held["adapter_params"] > 0
    assert held["base_with_grad_buffer"] == 0
    assert set(after) == set(reference["adapters"]) == set(start)
    for name, ref in reference["adapters"].items():
        if atol == "adam":  # a gradient near its own rounding makes a +-lr step (test_update)
            excess = (after[name] - ref).abs() - adam_first_step_bound(reference["grads"][name])
            assert excess.max() <= 0, name
        else:
            torch.testing.assert_close(after[name], ref, atol=atol, rtol=0, msg=name)
    if atol == "adam":
        return
    for name, ref in reference["merged"].items():
        torch.testing.assert_close(merged[name], ref, atol=atol, rtol=0, msg=name)
    for _, _, _, rank_log_probs, _ in results:
        for mine, ref in zip(rank_log_probs, reference["log_probs"]):
            torch.testing.assert_close(mine, ref, atol=1e-4, rtol=0)
    for key in ("pg_loss", "entropy", "kl_loss", "grad_norm"):
        assert metrics[f"actor/{key}"] == pytest.approx(reference[key], rel=1e-4, abs=1e-6), key
    assert metrics["actor/update_skipped"] == 0.0


def test_reference_moves_both_adapter_matrices_and_the_log_probs(tiny_models, batch, start,
                                                                 sgd_reference):
    """The PEFT step changes every A and B and the log-probs (else equality proves little)."""
    for name, value in start.items():
        assert (sgd_reference["adapters"][name] - value).abs().max() > 1e-3, name
    before = peft_model(tiny_models["qwen3"], start)
    with torch.no_grad():
        moved = max((hf_log_probs(before, s["tokens"]) - lp).abs().max().item()
                    for s, lp in zip(batch, sgd_reference["log_probs"]))
    assert moved > 1e-2


LAYOUTS = [
    (ParallelSizes(), {}),
    (ParallelSizes(), {"budget": 16}),
    (ParallelSizes(tp=2), {"budget": 16}),  # sequence parallel
    (ParallelSizes(tp=2, sequence_parallel=False), {}),
    (ParallelSizes(pp=2), {"budget": 16}),
    (ParallelSizes(cp=2), {}),
]


@pytest.mark.parametrize("sizes,kw", LAYOUTS, ids=[f"{s}-{k}" for s, k in LAYOUTS])
def test_lora_sgd_step_matches_peft(pool1, pool2, tiny_models, batch, start, sgd_reference,
                                    sizes, kw):
    pool = pool1 if sizes == ParallelSizes() else pool2
    results = pool.run(lora_update_on_rank, tiny_models["qwen3"], sizes, batch, start, **kw)
    assert_same_lora_update(results, sgd_reference, start)


# MoE models: adapters on the attention (qwen3_moe has no dense MLP) and on the shared expert
# (qwen2_moe); the routed experts have none.
MOE_CASES = {
    "qwen3_moe": (("linear_qkv", "linear_proj"), ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "qwen2_moe": (("linear_qkv", "linear_proj", "shared_experts.linear_fc1",
                   "shared_experts.linear_fc2"),
                  ["q_proj", "k_proj", "v_proj", "o_proj", "shared_expert.gate_proj",
                   "shared_expert.up_proj", "shared_expert.down_proj"]),
}


@pytest.fixture(scope="module")
def moe_references(tiny_models) -> dict[str, tuple]:
    """(batch, initial adapters, PEFT SGD step) per MoE model."""
    out = {}
    for name, (_, hf_targets) in MOE_CASES.items():
        model_dir = tiny_models[name]
        moe_batch = make_batch(model_dir)
        moe_start = initial_adapters(model_dir, hf_targets)
        out[name] = (moe_batch, moe_start,
                     peft_reference_step(model_dir, moe_batch, moe_start, "sgd", hf_targets))
    return out


MOE_LAYOUTS = [
    ("qwen3_moe", ParallelSizes(), {}),
    ("qwen3_moe", ParallelSizes(ep=2), {"budget": 16}),
    ("qwen3_moe", ParallelSizes(tp=2), {"budget": 20}),
    ("qwen2_moe", ParallelSizes(), {}),
    ("qwen2_moe", ParallelSizes(tp=2), {"budget": 20}),
]


@pytest.mark.parametrize("name,sizes,kw", MOE_LAYOUTS,
                         ids=[f"{n}-{s}-{k}" for n, s, k in MOE_LAYOUTS])
def test_moe_lora_sgd_step_matches_peft(pool1, pool2, tiny_models, moe_references, name, sizes,
                                        kw):
    moe_batch, moe_start, reference = moe_references[name]
    pool = pool1 if sizes == ParallelSizes() else pool2
    results = pool.run(lora_update_on_rank, tiny_models[name], sizes, moe_batch, moe_start,
                       targets=MOE_CASES[name][0], **kw)
    assert_same_lora_update(results, reference, moe_start)


def test_lora_adam_distributed_optimizer_with_data_parallel(pool2, tiny_models, batch, start):
    """AdamW sharded over DP=2 (megatron's distributed optimizer) on the adapters alone."""
    reference = peft_reference_step(tiny_models["qwen3"], batch, start, "adam")
    results = pool2.run(lora_update_on_rank, tiny_models["qwen3"], ParallelSizes(), batch, start,
                        optimizer="adam", dp_split=True)
    assert_same_lora_update(results, reference, start, atol="adam")
    for metrics, *_ in results:
        assert metrics["actor/grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)


def test_lora_bf16_base_stays_frozen_with_fp32_master_adapters(pool2, tiny_models, batch, start):
    """In bf16 the base weights keep their dtype and values; the optimizer steps fp32 master
    copies of the adapters only (TP=2, distributed AdamW)."""
    from safetensors.torch import load_file

    results = pool2.run(lora_update_on_rank, tiny_models["qwen3"], ParallelSizes(tp=2), batch,
                        start, optimizer="adam", dtype=torch.bfloat16, budget=16)
    metrics, held, after, _, merged = results[0]
    assert metrics["actor/update_skipped"] == 0.0
    assert held["trainable"] == held["adapter_params"] == held["optimized"] > 0
    assert held["base_with_grad_buffer"] == 0
    assert held["master_dtypes"] == ["torch.float32"]
    moved = [n for n in start if (after[n].float() - start[n].to(torch.bfloat16).float()).abs()
             .max() > 5e-4]
    assert len(moved) == len(start)
    original = load_file(f"{tiny_models['qwen3']}/model.safetensors")
    norm = "model.layers.0.input_layernorm.weight"  # no adapter: exported as loaded
    assert merged[norm].dtype == torch.bfloat16
    assert torch.equal(merged[norm], original[norm].to(torch.bfloat16))


def worker_lora_round(model_dir, batch):
    """Run on each rank: an ActorWorker with ``actor.lora`` (dropout on) driven as the trainer
    drives it: the HF export before and after one update, and the adapters."""
    from megarl.megatron.lora import peft_state_dict
    from megarl.megatron.optimizer import OptimizerSettings
    from megarl.megatron.settings import LoraSettings
    from megarl.megatron.update import LossSettings
    from megarl.megatron.worker import ActorSpec, ActorWorker

    spec = ActorSpec(
        model_path=model_dir, dtype="float32", sizes=ParallelSizes(),
        optim=OptimizerSettings(lr=1e-2, weight_decay=0.0, use_distributed_optimizer=False),
        loss=LossSettings(), with_ref=False, temperature=1.0, max_tokens_per_micro_batch=32,
        seed=1, lora=LoraSettings(rank=RANK, alpha=ALPHA, dropout=0.1, seed=1,
                                  exclude_modules=("layers.1.mlp.*",)))
    worker = ActorWorker(spec)
    before = worker.hf_state_dict()
    mini_batch = [{key: s[key].tolist() for key in ("tokens", "loss_mask", "old_log_probs",
                                                    "advantages")} for s in batch]
    metrics = worker.update([mini_batch])
    after = worker.hf_state_dict()
    return before, metrics, after, peft_state_dict(worker.actor.model)


def test_actor_worker_trains_lora_and_syncs_merged_weights(pool1, tiny_models, batch):
    """The worker the trainer drives: adapters start at B = 0 (the export is the base model),
    one update moves them, the export is then the PEFT merge of the adapters it holds; the
    excluded layer has none."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ((before, metrics, after, adapters),) = pool1.run(
        worker_lora_round, tiny_models["qwen3"], batch)
    original = load_file(f"{tiny_models['qwen3']}/model.safetensors")
    for name, value in original.items():
        assert torch.equal(before[name], value), name
    assert metrics[0]["actor/update_skipped"] == 0.0
    assert not any(".layers.1.mlp." in k for k in adapters)
    assert any(".layers.0.mlp.down_proj" in k for k in adapters)
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"], dtype=torch.float32)
    peft = get_peft_model(hf, LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=HF_TARGETS,
        exclude_modules=r".*layers\.1\.mlp\..*"))
    assert not set_peft_model_state_dict(peft, adapters).unexpected_keys
    merged = peft.merge_and_unload().state_dict()
    changed = 0
    for name, value in after.items():
        torch.testing.assert_close(value, merged[name], atol=1e-6, rtol=0, msg=name)
        changed += not torch.equal(value, original[name])
    assert changed == 7 + 4  # layer 0: q, k, v, o, gate, up, down; layer 1: q, k, v, o


def test_lora_dropout_acts_in_training_only(pool1, tiny_models):
    results = pool1.run(dropout_on_rank, tiny_models["qwen3"])
    train_a, train_b, eval_a, eval_b, no_dropout = results[0]
    assert not torch.equal(train_a, train_b)  # a new mask per forward
    assert torch.equal(eval_a, eval_b)
    torch.testing.assert_close(eval_a, no_dropout, atol=0, rtol=0)
    assert (train_a - eval_a).abs().max() > 1e-3


def dropout_on_rank(model_dir):
    """Run on a rank: one adapter's output twice in training and twice in eval mode with
    dropout 0.5, and in eval mode without dropout (B set away from zero)."""
    from megarl.megatron.lora import adapters, apply_lora
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.settings import LoraSettings

    outs = []
    for dropout in (0.5, 0.0):
        model = build_actor_model(model_dir, ParallelSizes(), torch.float32, spec="native")
        apply_lora(model, LoraSettings(rank=RANK, alpha=ALPHA, dropout=dropout,
                                       target_modules=("linear_proj",)))
        adapter = adapters(model)["layers.0.self_attention.linear_proj"]
        with torch.no_grad():
            adapter.lora_B[0].copy_(torch.randn(adapter.lora_B[0].shape,
                                             generator=torch.Generator().manual_seed(3)))
        x = torch.randn(5, 1, adapter.lora_A.shape[1], generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            if dropout:
                adapter.train()
                outs += [adapter(x), adapter(x)]
            adapter.eval()
            outs += [adapter(x)] * (2 if dropout else 1)
    return tuple(outs)


def train_and_export_peft(model_dir, sizes, batch, out):
    """Run on each rank: adapters (one projection excluded), one AdamW step, the PEFT adapter
    directory written; returns the stepped model's log-probs."""
    from megarl.megatron.logprobs import compute_log_probs
    from megarl.megatron.lora import apply_lora, save_peft_adapter
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.optimizer import OptimizerSettings, TrainableActor
    from megarl.megatron.settings import LoraSettings
    from megarl.megatron.update import LossSettings, TrainSequence, train_step

    settings = LoraSettings(rank=RANK, alpha=ALPHA, seed=3,
                            exclude_modules=("layers.1.self_attention.linear_proj",))
    model = build_actor_model(model_dir, sizes, torch.float32, spec="native")
    apply_lora(model, settings)
    actor = TrainableActor(model, OptimizerSettings(lr=1e-2, weight_decay=0.0))
    for _ in range(2):  # the second step moves A too (B is 0 before the first)
        train_step(actor, [TrainSequence(**s) for s in batch], LossSettings(),
                   max_tokens_per_micro_batch=16)
    save_peft_adapter(model, settings, out, base_model=model_dir)
    return compute_log_probs(model, [s["tokens"] for s in batch]).log_probs


@pytest.mark.parametrize("sizes", [ParallelSizes(tp=2), ParallelSizes(pp=2)],
                         ids=["tp2", "pp2"])
def test_exported_peft_adapter_gives_the_trained_log_probs(pool2, tiny_models, batch, tmp_path,
                                                           sizes):
    """``save_peft_adapter`` writes what ``PeftModel.from_pretrained`` loads on the HF model,
    and that model scores like the trained actor."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "adapter"
    trained = pool2.run(train_and_export_peft, tiny_models["qwen3"], sizes, batch, out)[0]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA
    assert "model.layers.1.self_attn.o_proj" not in config["target_modules"]
    assert len(config["target_modules"]) == 2 * 7 - 1
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"], dtype=torch.float32)
    base_scores = [hf_log_probs(hf, s["tokens"]).detach() for s in batch]
    model = PeftModel.from_pretrained(hf, str(out))
    with torch.no_grad():
        for s, mine, base in zip(batch, trained, base_scores):
            scored = hf_log_probs(model, s["tokens"])
            torch.testing.assert_close(scored, mine, atol=1e-4, rtol=0)
            assert (scored - base).abs().max() > 1e-3  # the adapters are in it


def dropout_masks_on_rank(model_dir, sizes):
    """Run on each rank: the training-mode outputs of a column-parallel adapter's input dropout
    (q/k/v of layer 0) and a row-parallel one's (o_proj), for the same input on every rank."""
    from megarl.megatron.lora import adapters, apply_lora
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.settings import LoraSettings

    model = build_actor_model(model_dir, sizes, torch.float32, spec="native")
    apply_lora(model, LoraSettings(rank=RANK, alpha=ALPHA, dropout=0.5))
    found = adapters(model)
    x = torch.ones(6, 1, found["layers.0.self_attention.linear_qkv"].in_features)
    out = {}
    for name in ("layers.0.self_attention.linear_qkv", "layers.0.self_attention.linear_proj"):
        adapter = found[name]
        adapter.train()
        out[name] = adapter._dropout(x[..., : adapter.lora_A.shape[1]])
    return out


def test_lora_dropout_masks_follow_the_sharding(pool2, tiny_models):
    """TP=2 without sequence parallelism: a column-parallel adapter's input is whole on both
    ranks and must get one mask (its A x feeds both ranks' B shards); a row-parallel adapter's
    input is each rank's own columns, which take their own masks."""
    results = pool2.run(dropout_masks_on_rank, tiny_models["qwen3"],
                        ParallelSizes(tp=2, sequence_parallel=False))
    column, row = "layers.0.self_attention.linear_qkv", "layers.0.self_attention.linear_proj"
    assert torch.equal(results[0][column], results[1][column])
    assert (results[0][column] == 0).any()
    assert not torch.equal(results[0][row], results[1][row])


def worker_two_updates(model_dir, batch, offload: bool):
    """Run on each rank: an ActorWorker with LoRA, driven as the colocated trainer drives it
    when ``offload`` (param, grad and optimizer state offloaded after each phase): update,
    offload, weight export, update, export; returns the last export."""
    from megarl.megatron.offload import OffloadSettings
    from megarl.megatron.optimizer import OptimizerSettings
    from megarl.megatron.settings import LoraSettings
    from megarl.megatron.update import LossSettings
    from megarl.megatron.worker import ActorSpec, ActorWorker

    spec = ActorSpec(
        model_path=model_dir, dtype="float32", sizes=ParallelSizes(),
        optim=OptimizerSettings(lr=1e-2, weight_decay=0.0, use_distributed_optimizer=False),
        loss=LossSettings(), with_ref=False, temperature=1.0, max_tokens_per_micro_batch=32,
        seed=1, lora=LoraSettings(rank=RANK, alpha=ALPHA, seed=1),
        offload=OffloadSettings(True, True, True) if offload else OffloadSettings())
    worker = ActorWorker(spec)
    mini_batch = [{key: s[key].tolist() for key in ("tokens", "loss_mask", "old_log_probs",
                                                    "advantages")} for s in batch]
    for _ in range(2):
        worker.update([mini_batch])
        worker.offload()
        exported = worker.hf_state_dict()
        worker.offload()
    return exported, sorted(worker.offloader.offloaded)


def test_lora_worker_offloads_and_reloads_its_state(pool1, tiny_models, batch):
    """Offloading the frozen base, the adapters' grads and their Adam state between phases
    changes nothing: two updates with offload export what two without it do."""
    plain, _ = pool1.run(worker_two_updates, tiny_models["qwen3"], batch, False)[0]
    offloaded, parts = pool1.run(worker_two_updates, tiny_models["qwen3"], batch, True)[0]
    assert parts == ["grad", "optimizer", "param"]
    for name, value in plain.items():
        assert torch.equal(offloaded[name], value), name


def r2_with_lora_on_rank(model_dir, batch, replay: bool):
    """Run on each rank (qwen3_moe, EP=2, routers that record and replay; attention adapters):
    routes recorded in the old-log-prob forward, then two mini-batch updates (the second after
    a large step) replaying them when ``replay``; the recorded and the used routes."""
    import dataclasses

    from megarl.megatron.optimizer import OptimizerSettings
    from megarl.megatron.settings import LoraSettings
    from megarl.megatron.update import LossSettings
    from megarl.megatron.worker import ActorSpec, ActorWorker

    spec = ActorSpec(
        model_path=model_dir, dtype="float32", sizes=ParallelSizes(ep=2),
        optim=OptimizerSettings(lr=0.5, weight_decay=0.0, use_distributed_optimizer=False),
        loss=LossSettings(), with_ref=False, temperature=1.0, max_tokens_per_micro_batch=96,
        seed=1, router_replay=True, lora=LoraSettings(rank=RANK, alpha=ALPHA, seed=1))
    worker = ActorWorker(spec)
    tokens = [s["tokens"].tolist() for s in batch]
    old = worker.compute_log_probs(tokens, record_routes=True)
    records = [{"tokens": s["tokens"].tolist(), "loss_mask": s["loss_mask"].tolist(),
                "old_log_probs": lp, "advantages": s["advantages"].tolist()}
               for s, lp in zip(batch, old["log_probs"])]
    if replay:
        records = [dict(r, routes=routes) for r, routes in zip(records, old["routes"])]
    worker.spec = dataclasses.replace(worker.spec, max_tokens_per_micro_batch=16)
    _, used = worker.update_recording_routes([records[:2], records[2:]])
    return old["routes"], used[0] + used[1]


def test_router_replay_r2_with_lora(pool2, tiny_models):
    """R2 works unchanged with adapters: the update replays exactly the routes recorded in the
    old-log-prob forward, which the large first step would otherwise change."""
    moe_batch = make_batch(tiny_models["qwen3_moe"])
    for replay in (True, False):
        old, used = pool2.run(r2_with_lora_on_rank, tiny_models["qwen3_moe"], moe_batch,
                              replay)[0]
        same = all(torch.equal(o.long(), u.long()) for o, u in zip(old, used))
        assert same == replay, f"replay={replay}"
