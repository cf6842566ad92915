"""Log-prob parity with HF transformers under every parallel layout, on real gloo ranks.

The reference is computed in the test process with HF transformers (fp32), independently of
megarl's code: ``log_softmax(logits / T)`` gathered at the next token, and the entropy of the
same distribution. Every rank of the megatron group must return the same values, within 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from megarl.megatron.parallel import ParallelSizes

TEMPERATURE = 0.8
TOLERANCE = 1e-4
# odd lengths exercise the per-sequence padding that sequence parallelism needs
LENGTHS = (9, 16, 5, 12, 7, 11)
TOKEN_BUDGET = 24  # several micro-batches, so the pipeline schedule really pipelines


def sequences(vocab: int = 128, seed: int = 0) -> list[torch.Tensor]:
    """The token sequences every test scores."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]


def hf_reference(model_dir: str, seqs: list[torch.Tensor]) -> tuple[list, list]:
    """Target-aligned log-probs and entropies from HF transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    log_probs, entropies = [], []
    for seq in seqs:
        with torch.no_grad():
            logits = model(seq[None]).logits[0].float() / TEMPERATURE
        logp = torch.log_softmax(logits, dim=-1)
        token_lp = logp[:-1].gather(-1, seq[1:, None])[:, 0]
        entropy = -(logp.exp() * logp).sum(-1)[:-1]
        log_probs.append(torch.cat([torch.zeros(1), token_lp]))
        entropies.append(torch.cat([torch.zeros(1), entropy]))
    return log_probs, entropies


@pytest.fixture(scope="module")
def references(tiny_models) -> dict[str, tuple[list, list]]:
    """HF reference results per tiny model."""
    seqs = sequences()
    return {name: hf_reference(path, seqs) for name, path in tiny_models.items()}


def score_on_rank(model_dir: str, sizes: ParallelSizes, dp_split: bool = False):
    """Run on each rank: build the model for ``sizes`` and score the sequences.

    With ``dp_split``, each data-parallel rank scores its own share (``seqs[dp_rank::dp]``).
    Returns (sequence indices, log-probs, entropies) as lists.
    """
    from megatron.core import parallel_state as mpu

    from megarl.megatron.logprobs import compute_log_probs
    from megarl.megatron.model import build_actor_model

    model = build_actor_model(model_dir, sizes, torch.float32, spec="native")
    seqs = sequences()
    indices = list(range(len(seqs)))
    if dp_split:
        dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        indices = indices[dp_rank::dp]
    out = compute_log_probs(
        model,
        [seqs[i] for i in indices],
        temperature=TEMPERATURE,
        with_entropy=True,
        max_tokens_per_micro_batch=TOKEN_BUDGET,
    )
    return indices, [t.tolist() for t in out.log_probs], [t.tolist() for t in out.entropy]


def assert_matches(rank_results, reference) -> None:
    """Every rank's values equal the HF reference within TOLERANCE."""
    ref_lp, ref_ent = reference
    for rank, (indices, log_probs, entropies) in enumerate(rank_results):
        for i, lp, ent in zip(indices, log_probs, entropies):
            lp_diff = (torch.tensor(lp) - ref_lp[i]).abs().max().item()
            ent_diff = (torch.tensor(ent) - ref_ent[i]).abs().max().item()
            assert lp_diff <= TOLERANCE, f"rank {rank} seq {i}: log-prob diff {lp_diff}"
            assert ent_diff <= TOLERANCE, f"rank {rank} seq {i}: entropy diff {ent_diff}"


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "qwen2", "qwen2_moe", "mixtral", "llama"])
def test_single_rank(pool1, tiny_models, references, name):
    results = pool1.run(score_on_rank, tiny_models[name], ParallelSizes())
    assert_matches(results, references[name])


TWO_RANK_LAYOUTS = [
    ("qwen3", ParallelSizes(tp=2, sequence_parallel=False)),
    ("qwen3", ParallelSizes(tp=2)),
    ("qwen3", ParallelSizes(pp=2)),
    ("qwen3_moe", ParallelSizes(tp=2)),
    ("qwen3_moe", ParallelSizes(tp=2, etp=1)),
    ("qwen3_moe", ParallelSizes(ep=2)),
    ("qwen3_moe", ParallelSizes(pp=2)),
    ("qwen3_4layers", ParallelSizes(pp=2, vpp=2)),
    ("qwen2_moe", ParallelSizes(tp=2)),  # shared experts and their gate under SP
    ("mixtral", ParallelSizes(ep=2)),
]


@pytest.mark.parametrize(
    "name,sizes", TWO_RANK_LAYOUTS, ids=[f"{n}-{s}" for n, s in TWO_RANK_LAYOUTS]
)
def test_two_ranks(pool2, tiny_models, references, name, sizes):
    results = pool2.run(score_on_rank, tiny_models[name], sizes)
    assert_matches(results, references[name])
    assert results[0] == results[1], "ranks of one model-parallel group disagree"


def test_data_parallel_split(pool2, tiny_models, references):
    """DP=2: each rank scores different sequences; together they cover all of them."""
    results = pool2.run(score_on_rank, tiny_models["qwen3_moe"], ParallelSizes(), dp_split=True)
    assert sorted(i for r in results for i in r[0]) == list(range(len(LENGTHS)))
    assert results[0][0] != results[1][0]
    assert_matches(results, references["qwen3_moe"])
