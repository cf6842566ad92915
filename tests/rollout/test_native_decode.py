"""The embedded engine's native decode backend (static KV cache) against HF transformers on the
CPU: next-token log-probs and routes while rows join and leave, and whole generations."""

from __future__ import annotations

import pytest
import torch

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.interface import SamplingParams
from megarl.rollout.local.engine import LocalEngine, Request
from megarl.rollout.local.model_runner import ModelRunner


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def model_dir(request, tmp_path_factory):
    """A tiny random model per architecture (head_dim 64)."""
    root = tmp_path_factory.mktemp(request.param)
    return make_tiny_model(root / "model", arch=request.param, seed=0, head_dim=64,
                           hidden_size=128, num_attention_heads=4, with_tokenizer=False)


def hf_next(model, sequences: list[list[int]]) -> tuple[torch.Tensor, list]:
    """log_softmax of the next-token logits after each whole sequence, and its routes."""
    from megarl.rollout.local.model_runner import RouterCapture

    capture = RouterCapture(model, int(getattr(model.config, "num_experts_per_tok", 0) or 0))
    logps, routes = [], []
    with torch.no_grad():
        for seq in sequences:
            capture.enabled = capture.num_layers > 0
            logits = model(torch.tensor([seq])).logits[0, -1]
            routes.append(capture.take(1, len(seq))[0, -1] if capture.enabled else None)
            capture.enabled = False
            logps.append(torch.log_softmax(logits, -1))
    return torch.stack(logps), routes


def test_rows_join_and_leave_with_hf_log_probs_and_routes(model_dir):
    runner = ModelRunner(model_dir, backend="native")
    assert runner.backend == "native"
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 300, 17)]
    out, kv = runner.prefill(seqs, routes=True)
    runner.append_rows(kv, [0, 1, 2])
    ref, _ = hf_next(runner.model, seqs)
    torch.testing.assert_close(torch.log_softmax(out.logits, -1), ref, atol=1e-5, rtol=0)
    logits = out.logits
    for step in range(5):
        seqs = [s + [t] for s, t in zip(seqs, logits.argmax(-1).tolist())]
        if step == 2:  # row 0 leaves, row 2 moves first, a new prompt joins
            runner.keep_rows([2, 1])
            seqs = [seqs[2], seqs[1]]
            new, kv = runner.prefill([[7, 8, 9]], routes=True)
            runner.append_rows(kv, [0])
            seqs.append([7, 8, 9, int(new.logits.argmax(-1))])
        out = runner.decode([s[-1] for s in seqs], routes=True)
        ref, ref_routes = hf_next(runner.model, seqs)
        torch.testing.assert_close(torch.log_softmax(out.logits, -1), ref, atol=1e-5, rtol=0)
        if out.routes is not None:
            assert torch.equal(out.routes[:, 0], torch.stack(ref_routes).to(torch.int32))
        logits = out.logits
    assert runner.native.cache.len_cap > 300  # grew past its first length


def generate(runner: ModelRunner, prompts: list[list[int]], params: SamplingParams) -> list:
    """Every prompt through a fresh engine; the results of each request."""
    engine = LocalEngine(runner, seed=0, max_running_requests=4)
    engine.start()
    routes = runner.router.num_layers > 0
    try:
        futures = [engine.submit(Request(f"r{i}", p, params, return_routed_experts=routes))
                   for i, p in enumerate(prompts)]
        return [f.result(timeout=120) for f in futures]
    finally:
        engine.shutdown()


def test_engine_generations_equal_the_hf_backend(model_dir):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (3, 9, 14, 6, 11)]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, n=2)
    native = generate(ModelRunner(model_dir, backend="native"), prompts, params)
    hf = generate(ModelRunner(model_dir, backend="hf"), prompts, params)
    for a_req, b_req in zip(native, hf):
        for a, b in zip(a_req, b_req):
            assert a.output_ids == b.output_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                       atol=1e-4, rtol=0)
            if b.routed_experts is not None:
                assert torch.equal(a.routed_experts, b.routed_experts)


def test_chunked_inverse_cdf_picks_what_the_full_cumulative_sum_picks():
    from megarl.rollout.local.sampling import chunked_inverse_cdf, inverse_cdf

    g = torch.Generator().manual_seed(2)
    for trial in range(50):
        vocab = int(torch.randint(2049, 9000, (1,), generator=g))
        weights = torch.rand(5, vocab, generator=g, dtype=torch.float64) ** 8
        weights[weights < 0.3] = 0
        if trial % 3 == 0:
            weights[:, vocab // 2:] = 0  # trailing zero mass: never picked
        uniforms = torch.rand(5, generator=g, dtype=torch.float64)
        picks = chunked_inverse_cdf(weights, uniforms)
        assert torch.equal(picks, inverse_cdf(weights, uniforms))
        assert (weights.gather(1, picks[:, None]) > 0).all()


@pytest.mark.parametrize("path", ["all_experts", "grouped_experts"])
def test_gpu_moe_decode_paths_equal_hf(model_dir, path, monkeypatch):
    """The GPU decode paths of the MoE layer, forced on the CPU: every expert on every row
    weighted by the router (few rows), and the grouped expert GEMMs (above ALL_EXPERTS_ROWS
    rows, probed on CUDA); the same logits and routes as HF's model."""
    from megarl.rollout.local import static_kv

    native = ModelRunner(model_dir, backend="native")
    if not native.native.moe:
        pytest.skip("dense model")
    native.native.fast_kernels = True
    native.native._fast_checked = True
    if path == "grouped_experts":
        monkeypatch.setattr(static_kv, "ALL_EXPERTS_ROWS", 0)
        native.native.grouped_experts = True
    hf = ModelRunner(model_dir, backend="hf")
    contexts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]
    for runner in (native, hf):
        _, kv = runner.prefill(contexts, routes=False)
        runner.append_rows(kv, [0, 1, 2])
    tokens = [1, 2, 3]
    for _ in range(3):
        ours, ref = native.decode(tokens, routes=True), hf.decode(tokens, routes=True)
        torch.testing.assert_close(ours.logits, ref.logits, atol=1e-5, rtol=0)
        assert torch.equal(ours.routes, ref.routes)
        tokens = ref.logits.argmax(-1).tolist()


def test_fused_projections_alias_the_live_weights(model_dir):
    """One GEMM over the fused q/k/v (and gate/up) weights computes the separate projections,
    and a weight update written into the HF parameters in place reaches the fused tensor."""
    from megarl.rollout.local.fused_projections import FusedLayer
    from megarl.rollout.local.weights import WeightMap

    runner = ModelRunner(model_dir, backend="hf")
    layer = runner.model.model.layers[0]
    attn = layer.self_attn
    x = torch.randn(5, runner.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    separate = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    fused = FusedLayer.of(layer)
    assert fused.qkv.scale_inv is None
    torch.testing.assert_close(fused.qkv(x), separate)
    assert attn.k_proj.weight.data_ptr() == fused.qkv.weight[fused.qkv_sizes[0]:].data_ptr()
    if hasattr(layer.mlp, "gate_proj"):
        torch.testing.assert_close(fused.gate_up(x), torch.cat([layer.mlp.gate_proj(x),
                                                                layer.mlp.up_proj(x)], dim=-1))
    new_k = torch.randn_like(attn.k_proj.weight)
    WeightMap(runner.model).load("model.layers.0.self_attn.k_proj.weight", new_k)
    start, size = fused.qkv_sizes[0], fused.qkv_sizes[1]
    assert torch.equal(fused.qkv.weight[start:start + size], new_k)
    torch.testing.assert_close(fused.qkv(x)[:, start:start + size], x @ new_k.T)


def test_fp8_projections_fuse_their_blocks_and_take_weight_updates(tmp_path):
    """Block-FP8 q/k/v and gate/up of whole 128-row blocks fuse as SGLang's FP8 qkv and gate_up
    layers do: the fused weight and ``weight_scale_inv`` are the concatenations, one w8a8 GEMM
    equals the separate ones, and a synced FP8 weight and its scales land in the fused tensors.
    Projections whose rows straddle a block are left unfused."""
    from megarl.rollout.local.fp8_layers import fp8_matmul_reference
    from megarl.rollout.local.fused_projections import FusedLayer
    from megarl.rollout.local.weights import WeightMap
    from megarl.weights.fp8 import quantize_blockwise

    model_dir = make_tiny_model(tmp_path / "dense", arch="qwen3", seed=0, head_dim=64,
                                hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=384, with_tokenizer=False)
    runner = ModelRunner(model_dir, backend="hf", quantization="fp8")
    layer = runner.model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    separate_qkv = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    separate_gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
    fused = FusedLayer.of(layer)
    assert fused.qkv_sizes == (256, 128, 128)
    assert fused.qkv.weight.dtype == torch.float8_e4m3fn and fused.qkv.scale_inv.shape == (4, 2)
    assert fused.gate_up.weight.shape == (768, 256) and fused.gate_up.scale_inv.shape == (6, 2)
    torch.testing.assert_close(fused.qkv(x), separate_qkv, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fused.gate_up(x), separate_gate_up, atol=1e-6, rtol=1e-6)
    assert attn.v_proj.weight_scale_inv.data_ptr() == fused.qkv.scale_inv[3:].data_ptr()
    # a weight sync writes the k projection's FP8 weight and scales (fp8_payload's names)
    new_k, new_scale = quantize_blockwise(torch.randn(128, 256, generator=torch.Generator()
                                                      .manual_seed(1)))
    weights = WeightMap(runner.model)
    weights.load("model.layers.0.self_attn.k_proj.weight", new_k)
    weights.load("model.layers.0.self_attn.k_proj.weight_scale_inv", new_scale)
    assert torch.equal(fused.qkv.weight[256:384].float(), new_k.float())
    assert torch.equal(fused.qkv.scale_inv[2:3], new_scale)
    torch.testing.assert_close(fused.qkv(x)[:, 256:384], fp8_matmul_reference(x, new_k, new_scale),
                               atol=1e-6, rtol=1e-6)
    # k/v of 64 rows each (half a block): not fused, the projections run on their own
    odd = make_tiny_model(tmp_path / "odd", arch="qwen3", seed=0, head_dim=64, hidden_size=256,
                          num_attention_heads=4, num_key_value_heads=1, intermediate_size=384,
                          with_tokenizer=False)
    odd_layer = ModelRunner(odd, backend="hf", quantization="fp8").model.model.layers[0]
    assert FusedLayer.of(odd_layer).qkv is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_transformers_expert_block(dtype):
    """The decoder's grouped expert GEMMs (above ALL_EXPERTS_ROWS rows) against transformers'
    own Qwen3-MoE expert block in its eager loop, with experts that no row chose."""
    import torch.nn.functional as F
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from megarl.rollout.local.decode_ops import grouped_experts

    config = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=16,
                            num_experts_per_tok=3)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.1)
        experts.down_proj.normal_(0, 0.1)
    x = torch.randn(11, 64, dtype=dtype)
    index = torch.rand(11, 12).topk(3, dim=-1).indices  # experts 12-15 get no row
    weights = torch.rand(11, 3).to(dtype)

    def swiglu(t):
        gate, up = t.chunk(2, dim=-1)
        return F.silu(gate) * up

    got = grouped_experts(experts, x, index, weights, swiglu)
    with torch.no_grad():
        expected = experts(x, index, weights)
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6 if dtype == torch.float32
                               else 2e-2 * float(expected.abs().max()))

