"""The embedded engine's native decode path on CUDA in bf16: prefill and CUDA-graph decode steps
against HF transformers' forward over the whole sequence, rows joining and leaving."""

from __future__ import annotations

import pytest
import torch

from megarl.data.tiny_model import make_tiny_model


def hf_next_logprobs(model, sequences: list[list[int]]) -> torch.Tensor:
    """log_softmax of the next-token logits after each whole sequence (no KV cache)."""
    out = []
    with torch.no_grad():
        for seq in sequences:
            logits = model(torch.tensor([seq], device="cuda")).logits[0, -1].float()
            out.append(torch.log_softmax(logits, -1))
    return torch.stack(out)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_native_decode_matches_hf_forward(tmp_path, arch):
    from megarl.rollout.local.model_runner import ModelRunner

    model_dir = make_tiny_model(tmp_path / arch, arch=arch, seed=0, head_dim=64,
                                hidden_size=128, num_attention_heads=4, with_tokenizer=False)
    runner = ModelRunner(model_dir, device="cuda", dtype="bfloat16")
    assert runner.backend == "native"
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 300, 17)]
    out, kv = runner.prefill(seqs, routes=False)
    runner.append_rows(kv, [0, 1, 2])
    ref = hf_next_logprobs(runner.model, seqs)
    assert (torch.log_softmax(out.logits, -1) - ref).abs().max() < 0.1
    logits = out.logits
    for step in range(6):
        seqs = [s + [t] for s, t in zip(seqs, logits.argmax(-1).tolist())]
        if step == 3:  # row 0 leaves, a new prompt joins
            runner.keep_rows([2, 1])
            seqs = [seqs[2], seqs[1]]
            new, kv = runner.prefill([[7, 8, 9]], routes=False)
            runner.append_rows(kv, [0])
            seqs.append([7, 8, 9, int(new.logits.argmax(-1))])
        logits = runner.decode([s[-1] for s in seqs], routes=False).logits
        ref = hf_next_logprobs(runner.model, seqs)
        assert (torch.log_softmax(logits, -1) - ref).abs().max() < 0.1, step
    assert runner.native.flash, "FlashAttention decode failed its check against the fp32 path"
