"""Weight gradients accumulated straight into fp32 ``main_grad`` on a GPU
(megarl/megatron/wgrad_fusion.py): the bf16 GEMM with an fp32 output adds in place, and an
update of megarl's actor with megatron's linear layers and the chunked output layer switched to
it gives the gradients and the step of the unfused update."""

from __future__ import annotations

import pytest
import torch

from megarl.data.tiny_model import make_tiny_model


def test_the_bf16_weight_gradient_adds_into_the_fp32_buffer():
    from megarl.megatron.wgrad_fusion import accumulate_weight_grad

    g = torch.Generator(device="cuda").manual_seed(0)
    grad_output = torch.randn(4096, 768, device="cuda", generator=g).bfloat16()
    total_input = torch.randn(4096, 512, device="cuda", generator=g).bfloat16()
    main_grad = torch.randn(768, 512, device="cuda", generator=g)
    before, address = main_grad.clone(), main_grad.data_ptr()
    accumulate_weight_grad(main_grad, grad_output, total_input)
    assert main_grad.data_ptr() == address and main_grad.dtype == torch.float32
    want = before + grad_output.float().t() @ total_input.float()
    torch.testing.assert_close(main_grad, want, rtol=1e-3, atol=1e-2)


def _one_step(model_dir, fuse: bool) -> dict:
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.optimizer import OptimizerSettings, TrainableActor
    from megarl.megatron.parallel import ParallelSizes
    from megarl.megatron.update import LossSettings, TrainSequence, train_step

    model = build_actor_model(str(model_dir), ParallelSizes(), torch.bfloat16)
    actor = TrainableActor(model, OptimizerSettings(lr=1e-3), fuse_wgrad=fuse)
    g = torch.Generator().manual_seed(0)
    seqs = [TrainSequence(tokens=torch.randint(0, 128, (n,), generator=g),
                          loss_mask=torch.ones(n), old_log_probs=torch.full((n,), -5.0),
                          advantages=torch.randn(n, generator=g)) for n in (40, 70, 30)]
    grads: dict[str, torch.Tensor] = {}
    params = dict(model.chunks[0].named_parameters())
    original_step = actor.step

    def step(loss_is_finite: bool):  # the reduced gradients, before the optimizer uses them
        grads.update({n: p.main_grad.detach().clone() for n, p in params.items()})
        return original_step(loss_is_finite)

    actor.step = step
    metrics = train_step(actor, seqs, LossSettings(), max_tokens_per_micro_batch=64)
    return {"layers": actor.fused_wgrad_layers, "metrics": metrics, "grads": grads,
            "params": {n: p.detach().float().clone() for n, p in params.items()}}


MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_an_update_with_fused_weight_gradients_matches_the_unfused_one(tmp_path, megatron_rank,
                                                                        arch):
    """qwen3_moe: the grouped expert GEMMs add their weight gradients into DDP's buffer too."""
    from megarl.megatron.parallel import destroy_parallel

    model_dir = make_tiny_model(tmp_path / "m", arch=arch, seed=0, hidden_size=256,
                                intermediate_size=512, num_hidden_layers=2,
                                tie_word_embeddings=False, **(MOE if arch == "qwen3_moe" else {}))
    plain = _one_step(model_dir, fuse=False)
    destroy_parallel()
    fused = _one_step(model_dir, fuse=True)
    # qkv, proj, fc1, fc2 (grouped: the experts' fc1 and fc2) a layer and the output layer (its
    # own weight: untied)
    assert plain["layers"] == 0 and fused["layers"] == 2 * 4 + 1
    assert fused["metrics"]["actor/grad_norm"] == pytest.approx(
        plain["metrics"]["actor/grad_norm"], rel=1e-2)
    assert any("output_layer" in n for n in fused["grads"])
    for name, want in plain["grads"].items():
        got = fused["grads"][name]
        scale = want.abs().max().item() + 1e-6
        assert (got - want).abs().max().item() <= 2e-2 * scale, name
    # Adam's first step moves each parameter by ~lr x the sign of its gradient: where that is
    # ~0, the two runs' bf16 rounding may pick opposite signs (2 x lr apart; on an H100 3 of
    # 16,384 elements of one matrix differed by 1.6e-3); everything else agrees closely
    lr, close, total = 1e-3, 0, 0
    for name, want in plain["params"].items():
        diff = (fused["params"][name] - want).abs()
        assert diff.max().item() <= 2 * lr + 1e-4, name
        close += int((diff <= 1e-4 + 1e-2 * want.abs()).sum())
        total += diff.numel()
    assert close >= 0.999 * total, (close, total)
