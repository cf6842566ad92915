"""GraphedChunk's plumbing on the CPU (``emulate=True``: the same buffers, leaf aliases and
autograd routing as the CUDA graphs, each replay run eagerly)."""

from __future__ import annotations

import torch


def graphed_against_eager_on_rank(model_dir):
    """Two micro-batches through one GraphedChunk bucket, with the weights changed in place
    between them (as an optimizer step does): logits and parameter gradients against the eager
    forward; the aliases the bucket runs on share the parameters' storage."""
    from megarl.megatron.cuda_graphs import GraphedChunk
    from megarl.megatron.logprobs import gpt_forward
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.packing import pack_sequences
    from megarl.megatron.parallel import ParallelSizes

    torch.manual_seed(0)
    model = build_actor_model(model_dir, ParallelSizes(), torch.float32)
    chunk = model.chunks[0]
    module = getattr(chunk, "module", chunk)
    params = [p for p in module.parameters() if p.requires_grad]
    graphed = GraphedChunk(chunk, bucket_tokens=16, emulate=True)
    out = {"logit_gaps": [], "grad_gaps": [], "shared": None, "leaf": None}
    for step in range(2):
        seqs = [torch.randint(3, 100, (n,)) for n in (5, 7)]
        batch = pack_sequences(seqs)
        weight = torch.randn(batch.num_tokens, 1)

        def loss_of(logits, weight=weight):
            return (logits[0].float().log_softmax(-1)[:, 7:11] * weight).sum()

        for p in params:
            p.grad = None
        logits = graphed(batch)
        loss_of(logits).backward()
        graphed_grads = [None if p.grad is None else p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        eager = gpt_forward(chunk, batch)
        loss_of(eager).backward()
        out["logit_gaps"].append((logits - eager).abs().max().item())
        out["grad_gaps"].append(max((g - p.grad).abs().max().item()
                                    for g, p in zip(graphed_grads, params)
                                    if g is not None and p.grad is not None))
        out["missing"] = sum((g is None) != (p.grad is None)
                             for g, p in zip(graphed_grads, params))
        with torch.no_grad():  # an optimizer step: in place, as megatron's optimizers do
            for p in params:
                p.add_(torch.randn_like(p) * 0.05)
    (bucket,) = graphed.buckets.values()
    leaves = list(bucket.leaves.values())
    out["shared"] = all(a.data_ptr() == p.data_ptr() for a, p in zip(leaves, params))
    out["leaf"] = all(a.is_leaf and a is not p for a, p in zip(leaves, params))
    out["count"] = (len(leaves), len(params))
    return out


def test_graphed_chunk_runs_on_aliases_that_follow_the_weights(pool1, tiny_models):
    (out,) = pool1.run(graphed_against_eager_on_rank, tiny_models["qwen3"])
    assert out["shared"] and out["leaf"], out
    assert out["count"][0] == out["count"][1] > 0
    assert out["missing"] == 0
    # the second micro-batch runs after the in-place step: stale aliases would differ by the
    # step's effect (logits move by ~1e-1 with 5e-2 noise on every weight)
    assert max(out["logit_gaps"]) < 1e-5, out
    assert max(out["grad_gaps"]) < 1e-5, out
