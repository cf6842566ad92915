"""megarl's FP8 payload (``megarl.weights.fp8.fp8_payload``) for a tiny Qwen3-MoE against what
an SGLang server with an FP8 block-quantized config (``weight_block_size: [128, 128]``) loads.

Checked against SGLang's own code where it runs on CPU:
- ``block_quant_dequant`` (``srt/layers/quantization/fp8_utils.py``): what SGLang takes an fp8
  weight + ``weight_scale_inv`` to mean equals megarl's dequantization, bit for bit;
- ``FusedMoE.make_expert_params_mapping`` (``srt/layers/moe/fused_moe_triton/layer.py``, the
  classmethod's source compiled alone): every expert tensor of the payload, scales included,
  maps onto ``experts.w13_*`` / ``experts.w2_*`` parameters.
The parameters themselves (``Fp8LinearMethod.create_weights`` / ``Fp8MoEMethod.create_weights``
in ``srt/layers/quantization/fp8.py``) need SGLang's distributed state and CUDA kernels and do not
build on CPU: their dtype and shape rules are restated below from that source (docs/fp8.md
gives the line numbers) — weight float8_e4m3fn, scale float32 [ceil(out/128), ceil(in/128)],
and every fused partition (q, k, v; gate, up; the experts' intermediate size) a multiple of 128.
"""

from __future__ import annotations

import ast
import math

import pytest
import sglang_ref
import torch
from safetensors.torch import load_file

from megarl.data.tiny_model import make_tiny_model
from megarl.weights.fp8 import dequantize_blockwise, fp8_payload, scale_name

DIMS = {"hidden_size": 192, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "moe_intermediate_size": 128}
EXPERTS = 4


@pytest.fixture(scope="module")
def bucket(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The tiny Qwen3-MoE's tensors in bf16, as the train side streams them."""
    path = make_tiny_model(tmp_path_factory.mktemp("fp8_qwen3_moe"), arch="qwen3_moe",
                           with_tokenizer=False, **DIMS)
    return {n: t.to(torch.bfloat16) for n, t in load_file(path / "model.safetensors").items()}


def sglang_block_quant_dequant():
    return sglang_ref.load_definitions("srt/layers/quantization/fp8_utils.py",
                                       ["block_quant_dequant"],
                                       {"torch": torch, "List": list})["block_quant_dequant"]


def sglang_expert_params_mapping():
    """``FusedMoE.make_expert_params_mapping``, the classmethod compiled from SGLang's source."""
    path = sglang_ref.source_of("srt/layers/moe/fused_moe_triton/layer.py")
    tree = ast.parse(path.read_text())
    fused_moe = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "FusedMoE")
    method = next(n for n in fused_moe.body if isinstance(n, ast.FunctionDef)
                  and n.name == "make_expert_params_mapping")
    method.decorator_list = []
    scope = {"List": list, "Tuple": tuple}  # its annotations' names
    exec(compile(ast.Module(body=[method], type_ignores=[]), str(path), "exec"), scope)  # noqa: S102
    return lambda **kw: scope["make_expert_params_mapping"](None, **kw)


def sglang_param_name(name: str, expert_mapping: list) -> str:
    """The parameter Qwen3MoeForCausalLM.load_weights (``srt/models/qwen3_moe.py``) hands
    ``name`` to: stacked q/k/v and gate/up outside the experts, then the expert mapping."""
    for param, shard in (("qkv_proj", "q_proj"), ("qkv_proj", "k_proj"), ("qkv_proj", "v_proj"),
                         ("gate_up_proj", "gate_proj"), ("gate_up_proj", "up_proj")):
        if shard in name and "mlp.experts" not in name:
            return name.replace(shard, param)
    for param, weight_name, _, _ in expert_mapping:
        if weight_name in name:
            return name.replace(weight_name, param)
    return name


def test_payload_dequantizes_as_sglang_reads_it(bucket):
    payload = fp8_payload(bucket)
    block_quant_dequant = sglang_block_quant_dequant()
    quantized = [n for n in bucket if scale_name(n) in payload]
    assert len(quantized) == 2 * (4 + EXPERTS * 3)
    for name in quantized:
        weight, scale = payload[name], payload[scale_name(name)]
        theirs = block_quant_dequant(weight, scale, [128, 128], torch.float32)
        assert torch.equal(theirs, dequantize_blockwise(weight, scale)), name


def test_payload_names_dtypes_and_shapes_fit_sglangs_fp8_block_parameters(bucket):
    payload = fp8_payload(bucket)
    mapping = sglang_expert_params_mapping()(
        ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj",
        ckpt_up_proj_name="up_proj", num_experts=EXPERTS)
    params = {sglang_param_name(n, mapping) for n in payload}
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        for param in ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
                      "mlp.experts.w13_weight", "mlp.experts.w2_weight"):
            assert prefix + param in params and prefix + param + "_scale_inv" in params
        assert prefix + "mlp.gate.weight" in params  # the router: ReplicatedLinear, no quant
    for name, tensor in payload.items():
        if name.endswith("_scale_inv"):
            weight = payload[name.removesuffix("_scale_inv")]
            assert tensor.dtype == torch.float32
            assert tuple(tensor.shape) == tuple(math.ceil(d / 128) for d in weight.shape)
        elif scale_name(name) in payload:
            assert tensor.dtype == torch.float8_e4m3fn
        else:
            assert tensor.dtype == torch.bfloat16 and "proj" not in name, name
    # fused partitions SGLang's validate_block_quant_shapes / Fp8MoEMethod require whole blocks
    attn = "model.layers.0.self_attn."
    for part in ("q_proj", "k_proj", "v_proj"):
        assert payload[attn + part + ".weight"].shape[0] % 128 == 0
    assert DIMS["moe_intermediate_size"] % 128 == 0


def test_the_fp8_sync_buckets_are_laid_out_as_sglangs_tensor_bucket(bucket, sglang_tensor_bucket):
    """The weight sync with ``rollout.quantization=fp8`` (``plan_buckets`` + ``iter_buckets``,
    sent by ``flatten_into``): each bucket holds, in order, what ``fp8_payload`` gives for its
    tensors; its bytes and metadata equal SGLang's ``FlattenedTensorBucket(named_tensors=...)``
    of the same tensors (the unpadded layout an ``update_weights_from_distributed`` receiver
    rebuilds from names, dtypes and shapes), and SGLang's ``reconstruct_tensors`` gives them
    back bit for bit, fp8 weights and fp32 scales alike."""
    from megarl.weights.buckets import parse_dtype
    from megarl.weights.flattened import bucket_metadata, flatten_bucket
    from megarl.weights.sglang_sender import iter_buckets, plan_buckets

    specs = [(n, list(t.shape)) for n, t in bucket.items()]
    plan = plan_buckets(specs, "bfloat16", 0.1, quantization="fp8")
    assert len(plan) >= 3
    payload = fp8_payload(bucket)
    sent = [t for b in iter_buckets(bucket.items(), plan) for t in b]
    assert [n for n, _ in sent] == list(payload) == [n for b in plan for n, _, _ in b]
    for name, tensor in sent:
        assert tensor.dtype == payload[name].dtype and torch.equal(
            tensor.view(torch.uint8), payload[name].view(torch.uint8)), name
    for named, entries in zip(iter_buckets(bucket.items(), plan), plan):
        ours = flatten_bucket(named)
        theirs = sglang_tensor_bucket.FlattenedTensorBucket(named_tensors=named)
        assert torch.equal(ours["flattened_tensor"], theirs.get_flattened_tensor())
        layout = bucket_metadata([(n, s, parse_dtype(d)) for n, s, d in entries])
        assert [(m.name, m.start_idx, m.end_idx) for m in theirs.get_metadata()] == \
            [(m.name, m.start_idx, m.end_idx) for m in layout]
        rebuilt = sglang_tensor_bucket.FlattenedTensorBucket(
            flattened_tensor=ours["flattened_tensor"], metadata=theirs.get_metadata())
        for (name, got), (_, want) in zip(rebuilt.reconstruct_tensors(), named):
            assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8),
                                                           want.view(torch.uint8)), name


def test_a_plan_refuses_a_tensor_its_bucket_would_misalign():
    """An fp8 weight of an odd byte count followed by its fp32 scale cannot be viewed by
    SGLang's unpadded receiver: the plan says which tensor, before anything is sent."""
    from megarl.weights.sglang_sender import plan_buckets

    with pytest.raises(ValueError, match=r"q_proj.weight_scale_inv \(float32\) would start at "
                                         r"byte 15"):
        plan_buckets([("model.layers.0.self_attn.q_proj.weight", [3, 5])], "bfloat16", 1,
                     quantization="fp8")
