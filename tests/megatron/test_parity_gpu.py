"""Log-prob parity with HF transformers on CUDA in bf16 (one GPU, one NCCL rank)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import RankPool

from megarl.megatron.parallel import ParallelSizes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TEMPERATURE = 0.8
LENGTHS = (33, 64, 17, 48, 9)
# bf16 weights and activations on both sides, different kernels: per-token log-probs of the
# tiny random models (values around -5) agree to a few thousandths (measured on an H200:
# qwen3 0.0 max, qwen3_moe 0.005 max and 0.0005 mean)
MAX_ABS, MEAN_ABS = 0.05, 0.005


def sequences() -> list[torch.Tensor]:
    """The token sequences scored on both sides."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (n,), generator=g) for n in LENGTHS]


def hf_bf16_reference(model_dir: str) -> list[torch.Tensor]:
    """Target-aligned log-probs from HF transformers in bf16 on the GPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    out = []
    for seq in sequences():
        with torch.no_grad():
            logits = model(seq[None].cuda()).logits[0].float() / TEMPERATURE
        logp = torch.log_softmax(logits, dim=-1)[:-1].gather(-1, seq[1:, None].cuda())[:, 0]
        out.append(torch.cat([torch.zeros(1), logp.cpu()]))
    return out


def score_bf16(model_dir: str) -> dict:
    """Run on the GPU rank: build in bf16 and score; also report the spec and compat state."""
    from megarl.megatron import cpu_compat
    from megarl.megatron.logprobs import compute_log_probs
    from megarl.megatron.model import build_actor_model

    model = build_actor_model(model_dir, ParallelSizes(), torch.bfloat16)
    out = compute_log_probs(model, sequences(), temperature=TEMPERATURE)
    return {
        "log_probs": [t.cpu() for t in out.log_probs],
        "spec": model.spec,
        "compat": cpu_compat.enable(),
        "device": str(next(model.chunks[0].parameters()).device),
    }


@pytest.fixture(scope="module")
def gpu_pool():
    """One NCCL rank on GPU 0."""
    pool = RankPool(1, backend="nccl")
    yield pool
    pool.close()


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_bf16_parity_on_gpu(gpu_pool, tiny_models, name):
    (result,) = gpu_pool.run(score_bf16, tiny_models[name])
    assert result["compat"] is False and result["device"].startswith("cuda")
    diffs = torch.cat(
        [(a - b).abs() for a, b in zip(result["log_probs"], hf_bf16_reference(tiny_models[name]))]
    )
    print(f"{name} [{result['spec']} spec]: max {diffs.max():.4f} mean {diffs.mean():.5f}")
    assert diffs.max() <= MAX_ABS and diffs.mean() <= MEAN_ABS
