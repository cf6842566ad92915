"""Check a conversion by its outputs: Megatron's log-probs against HF transformers'.

The Megatron model is built on the ranks of a layout, with its weights either loaded from the HF
directory through mbridge or from a dist checkpoint (any layout), and scores a fixed set of
prompts; HF transformers scores the same tokens from the HF directory. Both give, for every
token after the first, log p(token | prefix); the largest absolute difference must stay under a
tolerance (by default 1e-3 in fp32, 0.1 in bf16/fp16). A wrong tensor anywhere (a swapped expert,
a mis-split QKV, a stale layer) moves these numbers far more than that.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bridge.checks import ConversionError, HFModel, Layout, inspect_hf_model
from bridge.launch import Runner, spawn_ranks
from bridge.mcore_checkpoint import find_model_checkpoint, load_model, read_convert_info

PROMPTS = (
    "The capital of France is Paris, and the capital of Japan is Tokyo.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Question: what is 12 * (3 + 4)? Answer: 84.",
    "Mixture-of-experts layers route every token to a few experts.",
)
DEFAULT_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}
MAX_PROMPT_TOKENS = 64


@dataclass(frozen=True)
class VerifyResult:
    """How far Megatron's log-probs are from HF's on the fixed prompts."""

    max_abs_diff: float
    mean_abs_diff: float
    tokens: int
    """Tokens compared (every prompt token after the first)."""
    tolerance: float
    per_prompt_max: tuple[float, ...]

    @property
    def passed(self) -> bool:
        """Whether the largest difference is within the tolerance."""
        return self.max_abs_diff <= self.tolerance


def prompt_token_ids(model: HFModel) -> list[list[int]]:
    """The prompts tokenized with the model's tokenizer, or fixed random ids without one."""
    vocab = int(model.config["vocab_size"])
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model.path))
        ids = [tokenizer(p, add_special_tokens=False)["input_ids"][:MAX_PROMPT_TOKENS]
               for p in PROMPTS]
        if all(len(s) >= 2 and max(s) < vocab for s in ids):
            return ids
    except (OSError, ValueError, KeyError):
        pass
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (24, 17, 31, 9)]


def hf_log_probs(hf_dir: Path, sequences: list[list[int]], dtype: str) -> list[torch.Tensor]:
    """log p(token_j | tokens_<j) from HF transformers; entry 0 of each sequence is 0."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=getattr(torch, dtype)).to(device).eval()
    results = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq], device=device)
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            token_lp = logp[:-1].gather(-1, ids[0, 1:, None])[:, 0].cpu()
            results.append(torch.cat([torch.zeros(1), token_lp]))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return results


def megatron_log_probs_on_rank(hf_dir: str, mcore_dir: str | None, layout: Layout, dtype: str,
                               sequences: list[list[int]]) -> list[list[float]]:
    """Run on every rank: build the model (HF weights or the checkpoint) and score the prompts."""
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from bridge.hf_to_mcore import build_model
    from megarl.megatron.logprobs import compute_log_probs

    model = build_model(hf_dir, layout, dtype, load_weights=mcore_dir is None)
    if mcore_dir is not None:
        try:
            load_model(model.chunks, Path(mcore_dir))
        except CheckpointingException as err:
            first = str(err).strip().splitlines()[0]
            raise ConversionError(f"--mcore {mcore_dir}: does not fit the model of --hf "
                                  f"{hf_dir} ({first})") from err
    out = compute_log_probs(model, [torch.tensor(s) for s in sequences])
    return [t.float().tolist() for t in out.log_probs]


def compare(megatron: list[list[float]], reference: list[torch.Tensor],
            tolerance: float) -> VerifyResult:
    """Absolute differences over every token after the first of each sequence."""
    diffs = [(torch.tensor(m[1:]) - r[1:]).abs() for m, r in zip(megatron, reference)]
    flat = torch.cat(diffs)
    return VerifyResult(max_abs_diff=float(flat.max()), mean_abs_diff=float(flat.mean()),
                        tokens=flat.numel(), tolerance=tolerance,
                        per_prompt_max=tuple(float(d.max()) for d in diffs))


def verify(hf: str | Path, mcore: str | Path | None = None, layout: Layout | None = None,
           dtype: str = "float32", tolerance: float | None = None,
           runner: Runner | None = None) -> VerifyResult:
    """Compare Megatron's log-probs (weights from ``hf``, or from the checkpoint ``mcore``)
    with HF transformers' on the fixed prompts (``layout`` defaults to one rank)."""
    layout = layout or Layout()
    model = inspect_hf_model(hf)
    layout.check(model.info)
    checkpoint = None if mcore is None else find_model_checkpoint(mcore)
    if checkpoint is not None:
        _check_same_family(checkpoint, model)
    sequences = prompt_token_ids(model)
    reference = hf_log_probs(model.path, sequences, dtype)
    per_rank = (runner or spawn_ranks)(
        layout.world_size, megatron_log_probs_on_rank, str(model.path),
        None if checkpoint is None else str(checkpoint), layout, dtype, sequences)
    limit = DEFAULT_TOLERANCE[dtype] if tolerance is None else tolerance
    return compare(per_rank[0], reference, limit)


def _check_same_family(checkpoint: Path, model: HFModel) -> None:
    """A checkpoint converted by megarl names its family; it must be the HF model's."""
    info: dict[str, Any] = read_convert_info(checkpoint)
    if info.get("model_type") not in (None, model.model_type):
        raise ConversionError(
            f"--mcore {checkpoint} holds a {info['model_type']} model but --hf {model.path} is "
            f"{model.model_type}; pass the HF directory the checkpoint was converted from")
