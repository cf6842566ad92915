"""Checks of the block-FP8 experts' Triton grouped GEMMs (``fp8_moe_triton``) against the
expert-by-expert reference (``Fp8Experts.reference``), on any device: CUDA in tests/gpu, CPU
tensors under ``TRITON_INTERPRET=1`` in tests/rollout/test_fp8_moe_interpreted.py; and an FP8
MoE engine's native decoder against its HF path (tests/rollout/test_fp8_engine.py on CPU,
tests/gpu on CUDA). Triton is imported only by the kernel checks. (A uniquely named module.)"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.local.fp8_layers import Fp8Experts


def random_experts(experts: int, hidden: int, width: int, device: str, seed: int = 0
                   ) -> Fp8Experts:
    """An :class:`Fp8Experts` quantized from random bf16-scale weights."""
    g = torch.Generator().manual_seed(seed)
    block = SimpleNamespace(num_experts=experts, hidden_dim=hidden, intermediate_dim=width,
                            act_fn=F.silu,
                            gate_up_proj=torch.randn(experts, 2 * width, hidden, generator=g) * 0.05,
                            down_proj=torch.randn(experts, hidden, width, generator=g) * 0.05)
    return Fp8Experts(block).to(device)


def random_routes(tokens: int, experts: int, top_k: int, device: str, seed: int = 1,
                  only: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k expert ids ``[T, k]``, distinct per row, softmaxed weights ``[T, k]``); with
    ``only``, every row's first choice is that expert (one expert with many rows)."""
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    if only is not None:
        index = torch.stack([torch.cat([torch.tensor([only]), row[row != only][:top_k - 1]])
                             for row in index])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
    return index.to(device), weights.to(device)


def fused(module: Fp8Experts, x: torch.Tensor, index: torch.Tensor,
          weights: torch.Tensor) -> torch.Tensor:
    return module.fused(x, index, weights)


def check_sort_by_expert(device: str) -> None:
    """Every (token, slot) pair once, each block one expert's pairs in token order, padding
    marked with the pair count, the length fixed by the shapes."""
    from megarl.rollout.local.fp8_moe_triton import BLOCK_M, sort_by_expert

    experts, tokens, top_k = 5, 23, 3
    index, _ = random_routes(tokens, experts, top_k, device, only=2)
    index[4] = torch.tensor([0, 1, 3])  # expert 4 chosen by few rows, none by some: fine
    rows, block_expert, total = sort_by_expert(index, experts, BLOCK_M)
    pairs = tokens * top_k
    assert rows.numel() == -(-(pairs + experts * (BLOCK_M - 1)) // BLOCK_M) * BLOCK_M
    rows, block_expert, total = rows.cpu(), block_expert.cpu(), int(total)
    flat = index.reshape(-1).cpu()
    counts = torch.bincount(flat, minlength=experts)
    assert total == int(((counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M).sum())
    assert (rows[total:] == pairs).all()
    used = rows[:total]
    assert sorted(used[used < pairs].tolist()) == list(range(pairs))
    for b in range(total // BLOCK_M):
        block = rows[b * BLOCK_M:(b + 1) * BLOCK_M]
        real = block[block < pairs]
        assert real.numel() > 0 and (flat[real] == block_expert[b]).all(), b
        assert real.tolist() == sorted(real.tolist())  # stable: token order inside an expert
        assert (block[real.numel():] == pairs).all()  # padding at the end of a run only
    assert block_expert[:total // BLOCK_M].tolist() == sorted(block_expert[:total // BLOCK_M]
                                                               .tolist())


def check_fused_matches_reference(device: str, dtype: torch.dtype = torch.float32) -> float:
    """The grouped GEMMs equal the reference on two layouts: hidden and intermediate sizes that
    are not multiples of 128 (partial K blocks; up's rows on their own block grid) and ones
    that are; a batch where one expert has more rows than a block. Returns the largest error
    (fp32: of an element, relative to the largest output; bf16: of the whole, relative, to
    the quantized math on fp32 inputs)."""
    worst = 0.0
    for experts, hidden, width, tokens, top_k in ((6, 200, 96, 7, 2), (8, 256, 128, 40, 2)):
        module = random_experts(experts, hidden, width, device)
        g = torch.Generator().manual_seed(2)
        x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
        index, weights = random_routes(tokens, experts, top_k, device, only=3)
        want = module.reference(x, index, weights)
        got = fused(module, x, index, weights)
        assert got.dtype == want.dtype == dtype and got.shape == want.shape == x.shape
        diff = got.float() - want.float()
        if dtype == torch.float32 and device == "cpu":  # the order of the fp32 sums only
            error = float(diff.abs().max() / want.abs().max())
            assert error < 1e-5, (hidden, width, error)
        elif dtype == torch.float32:
            # on the GPU both sides sum FP8 products in the tensor cores' precision (cuBLAS's
            # block-scaled GEMM, Triton's fp8 dot): 0.5% of the largest output on the H200
            error = float(diff.norm() / want.float().norm())
            assert error < 1e-2, (hidden, width, error)
        else:
            # bf16 rounds each GEMM's output, and a rounding step upstream can move an
            # activation to the next FP8 value (1/16 of it): the reference itself is ~3% off
            # the same quantized math on fp32 inputs. The fused path may not be further off
            truth = module.reference(x.float(), index, weights)
            off = [float((y.float() - truth).norm() / truth.norm()) for y in (got, want)]
            error = off[0]
            assert off[0] < 1.2 * off[1] + 2e-3, (hidden, width, off)
        worst = max(worst, error)
    return worst


def check_quantize_activations(device: str, exact: bool) -> None:
    """The one-launch activation quantization (``fp8_quant_triton``) against the torch ops of
    ``quantize_activations`` on the same device, bit for bit, in fp32 and bf16: rows padded (zeros, scale 1), a
    partial last group, an all-zero group, scales row-major or outer-dim-major. ``exact``: the
    inputs are e4m3 values times a power of two per group (the interpreter's e4m3 rounding is
    wrong at exponent carries, so on CPU only the indexing and layout are checked); else
    random (the GPU's rounding)."""
    import torch.nn.functional as F

    from megarl.rollout.local.fp8_quant_triton import quantize_activations_triton
    from megarl.weights.fp8 import FP8_MAX, quantize_activations

    g = torch.Generator().manual_seed(5)
    rows, k = 5, 300
    if exact:
        codes = torch.randint(0, 256, (rows, k), generator=g, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0  # e4m3fn's NaNs
        values = codes.view(torch.float8_e4m3fn).float()
        values[:, ::128] = FP8_MAX  # each group's amax: 448 x its power of two
        x = values * 2.0 ** torch.randint(-8, 8, (rows, 1), generator=g).float()
    else:
        x = torch.randn(rows, k, generator=g) * 3
    x[2, 128:256] = 0
    for dtype in (torch.float32, torch.bfloat16):
        inputs = x.to(device, dtype)
        for multiple, outer in ((1, False), (4, True)):
            got, scales = quantize_activations_triton(inputs, multiple, scales_outer_major=outer)
            padded = -(-rows // multiple) * multiple
            want, want_scales = quantize_activations(F.pad(inputs, (0, 0, 0, padded - rows)))
            assert got.shape == (padded, k) and scales.shape == (padded, 3)
            assert scales.stride() == ((1, padded) if outer else (3, 1))
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (dtype, multiple)
            assert torch.equal(scales, want_scales), (dtype, multiple)
            assert float(scales[2, 1]) == 1.0 and not got[rows:].float().any()


def check_linear_triton(device: str, exact: bool) -> float:
    """The one-launch w8a8 linear (``fp8_quant_triton.fp8_linear_triton``: the activations
    quantized inside the GEMM) against ``fp8_matmul_reference`` (quantize, dequantize, fp32
    matmul), on N and K that are not multiples of the tiles; ``exact`` as in
    :func:`check_quantize_activations`. Returns the largest relative error (norm)."""
    from megarl.rollout.local.fp8_layers import fp8_matmul_reference
    from megarl.rollout.local.fp8_quant_triton import fp8_linear_triton
    from megarl.weights.fp8 import FP8_MAX, quantize_blockwise

    g = torch.Generator().manual_seed(6)
    weight, scale = quantize_blockwise(torch.randn(200, 300, generator=g) * 0.05)
    weight, scale = weight.to(device), scale.to(device)
    rows = 37
    if exact:
        codes = torch.randint(0, 256, (rows, 300), generator=g, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0
        x = codes.view(torch.float8_e4m3fn).float()
        x[:, ::128] = FP8_MAX
        x = x * 2.0 ** torch.randint(-8, 8, (rows, 1), generator=g).float()
    else:
        x = torch.randn(rows, 300, generator=g)
    worst = 0.0
    # fp32 sums in another order; on a GPU both sum FP8 products in the tensor cores'
    # precision (as for the grouped GEMMs); bf16 output rounding on top
    for dtype, bound in ((torch.float32, 1e-5 if exact else 2e-2), (torch.bfloat16, 2e-2)):
        inputs = x.to(device, dtype)
        got = fp8_linear_triton(inputs, weight, scale)
        want = fp8_matmul_reference(inputs, weight, scale)
        assert got.shape == (rows, 200) and got.dtype == dtype
        error = float((got.float() - want.float()).norm() / want.float().norm())
        assert error < bound, (dtype, error)
        worst = max(worst, error)
    return worst


def native_and_hf_runners(tmp_path, device: str, dtype: str, decode_steps: int,
                          arch: str = "qwen3_moe"):
    """An FP8 Qwen3-MoE (or dense Qwen3: ``arch``) on the native decoder and on the HF path,
    three prompts prefilled, then ``decode_steps`` greedy steps (the native one's tokens fed to
    both): (the two runners, each step's largest gap between their next-token log-probs). Every
    projection is whole 128-row blocks, so on CUDA the native decoder fuses q/k/v (and the dense
    gate/up) into one FP8 GEMM each."""
    from megarl.rollout.local.model_runner import ModelRunner

    mlp = {"moe_intermediate_size": 128} if arch == "qwen3_moe" else {"intermediate_size": 384}
    model_dir = make_tiny_model(tmp_path / arch, arch=arch, seed=0, head_dim=64,
                                hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                with_tokenizer=False, **mlp)
    runners = [ModelRunner(model_dir, device=device, dtype=dtype, quantization="fp8",
                           backend=backend) for backend in ("native", "hf")]
    assert [r.backend for r in runners] == ["native", "hf"]
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 40, 17)]
    logits = []
    for runner in runners:
        out, kv = runner.prefill(seqs, routes=False)
        runner.append_rows(kv, [0, 1, 2])
        logits.append(out.logits)
    gaps = []
    for _ in range(decode_steps):
        tokens = logits[0].argmax(-1).tolist()
        logits = [r.decode(tokens, routes=False).logits for r in runners]
        native, hf = (torch.log_softmax(x.float(), -1) for x in logits)
        gaps.append(float((native - hf).abs().max()))
    return runners, gaps
