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


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "qwen3_moe_grouped",
                                  "qwen3_split_fails"])
def test_native_decode_matches_hf_forward(tmp_path, arch, monkeypatch):
    """(``qwen3_moe_grouped``: every decode step through the grouped expert GEMMs, the path
    above ALL_EXPERTS_ROWS rows; ``qwen3_split_fails``: the split-K attention kernel raises at
    the first decode, FlashAttention's takes over.)"""
    from megarl.rollout.local import decode_attention_triton, static_kv
    from megarl.rollout.local.model_runner import ModelRunner

    grouped = arch == "qwen3_moe_grouped"
    split_fails = arch == "qwen3_split_fails"
    arch = arch.removesuffix("_grouped").removesuffix("_split_fails")
    if grouped:
        monkeypatch.setattr(static_kv, "ALL_EXPERTS_ROWS", 0)
    if split_fails:
        def broken(*args, **kwargs):
            raise RuntimeError("no kernel image")
        monkeypatch.setattr(decode_attention_triton, "decode_attention", broken)
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
    assert runner.native.flash, "fast decode attention failed its check against the fp32 path"
    assert runner.native.split_attention != split_fails, "split-K attention's probe"
    assert runner.native.grouped_experts == (arch == "qwen3_moe"), "grouped experts' probe"


def test_decode_graphs_are_captured_again_after_the_kv_cache_grows(tmp_path):
    """Rows joining past the cache's row bucket re-allocate the KV cache, which drops the decode
    graphs; the next decode must capture anew (into a fresh pool: re-using the dead pool's
    handle trips the caching allocator's ``use_count > 0`` assertion) and still match HF."""
    from megarl.rollout.local.model_runner import ModelRunner

    model_dir = make_tiny_model(tmp_path / "qwen3", arch="qwen3", seed=1, head_dim=64,
                                hidden_size=128, num_attention_heads=4, with_tokenizer=False)
    runner = ModelRunner(model_dir, device="cuda", dtype="bfloat16")
    native = runner.native
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 128, (9,), generator=g).tolist()]
    out, kv = runner.prefill(seqs, routes=False)
    runner.append_rows(kv, [0])
    logits = out.logits
    for step in range(6):
        seqs = [s + [t] for s, t in zip(seqs, logits.argmax(-1).tolist())]
        if step == 2:  # three rows join one: the cache grows to the next row bucket
            capacity = native.cache.rows_cap
            joining = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (4, 30, 12)]
            new, kv = runner.prefill(joining, routes=False)
            runner.append_rows(kv, [0, 1, 2])
            assert native.cache.rows_cap > capacity
            seqs += [s + [t] for s, t in zip(joining, new.logits.argmax(-1).tolist())]
        logits = runner.decode([s[-1] for s in seqs], routes=False).logits
        ref = hf_next_logprobs(runner.model, seqs)
        assert (torch.log_softmax(logits, -1) - ref).abs().max() < 0.1, step
    assert native.graphs.capture_failures == 0
    assert native.use_graphs and len(native.graphs.captured) == 1  # the 4-row bucket, captured anew
