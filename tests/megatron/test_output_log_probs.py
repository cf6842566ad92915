"""Log-probs straight from the hidden states (megarl.megatron.output_log_probs) against the
logits path (the output layer's full ``[T, V_local]`` logits, then vocab_parallel_log_probs):
values, and the gradients of every parameter, on one rank and under TP=2 with and without
sequence parallelism, with the rows forced into several chunks; and no tensor of ``T x V_local``
elements exists on the hidden-state path."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megarl.megatron.parallel import ParallelSizes

TEMPERATURE = 0.7


class _LargestOutput(TorchDispatchMode):
    """The largest tensor any op produced while active (elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def both_paths_on_rank(model_dir, sizes):
    from megarl.megatron import vocab_parallel
    from megarl.megatron.logprobs import gpt_forward, make_micro_batches, token_log_probs
    from megarl.megatron.model import build_actor_model

    vocab_parallel.CHUNK_ELEMENTS = 5 * 512  # 5 rows a chunk (10 under TP=2): many chunks
    torch.manual_seed(0)
    model = build_actor_model(model_dir, sizes, torch.float32)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 120, (n,), generator=g) for n in (90, 70, 41)]
    (batch,), _ = make_micro_batches(model, seqs, None)
    chunk = model.chunks[0]
    params = [p for p in chunk.parameters() if p.requires_grad]
    weights = torch.randn(batch.num_tokens, 2, generator=g)
    out = {}
    for hidden in (False, True):
        for p in params:
            p.grad = None
        watch = _LargestOutput()
        output = gpt_forward(chunk, batch, hidden=hidden)
        with watch:
            lp, ent = token_log_probs(model, output, batch.targets, TEMPERATURE, hidden=hidden)
            ((lp * weights[:, 0]).sum() + (ent * weights[:, 1]).sum()).backward()
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
        out[hidden] = {"lp": lp.detach(), "ent": ent.detach(), "grads": grads,
                       "largest": watch.largest, "shape": tuple(output.shape)}
    local_vocab = out[False]["shape"][-1]
    return {
        "lp_gap": (out[True]["lp"] - out[False]["lp"]).abs().max().item(),
        "ent_gap": (out[True]["ent"] - out[False]["ent"]).abs().max().item(),
        "grad_gap": max(((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()
                        for a, b in zip(out[True]["grads"], out[False]["grads"])),
        "grad_norm": sum(float(b.norm()) for b in out[False]["grads"]),
        "largest_hidden_path": out[True]["largest"],
        "largest_logits_path": out[False]["largest"],
        "full_logits": batch.num_tokens * local_vocab,
        "tokens": batch.num_tokens,
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """qwen3 with a vocabulary of 512 (8x the hidden size), tied and untied."""
    from megarl.data.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("output_log_probs")
    return {tie: str(make_tiny_model(root / str(tie), arch="qwen3", seed=5, vocab_size=512,
                                     tie_word_embeddings=tie)) for tie in (False, True)}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_one_rank(pool1, models, tie):
    (r,) = pool1.run(both_paths_on_rank, models[tie], ParallelSizes())
    assert r["lp_gap"] < 1e-5 and r["ent_gap"] < 1e-5, r
    assert r["grad_gap"] < 1e-4 and r["grad_norm"] > 0, r
    # the logits path holds T x V logits; the hidden-state path never does (chunks of 5 rows;
    # its largest tensors are the MLP's T x 2I activations of the model's backward, I = V / 4)
    assert r["largest_logits_path"] >= r["full_logits"], r
    assert r["largest_hidden_path"] < r["full_logits"], r


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no_sp"])
def test_two_tensor_parallel_ranks(pool2, models, sp):
    results = pool2.run(both_paths_on_rank, models[False],
                        ParallelSizes(tp=2, sequence_parallel=sp))
    for r in results:
        assert r["lp_gap"] < 1e-5 and r["ent_gap"] < 1e-5, r
        assert r["grad_gap"] < 1e-4 and r["grad_norm"] > 0, r
        assert r["largest_logits_path"] >= r["full_logits"], r
        assert r["largest_hidden_path"] < r["full_logits"], r
