"""SGLang payloads and answers across versions, and SamplingParams <-> SGLang fields."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from megarl.rollout.interface import SamplingParams
from megarl.rollout.routed_experts import RoutedExpertsLayout
from megarl.rollout.sglang.codec import (
    ResponseFormatError,
    decode_generate_answer,
    generate_payload,
    parse_finish_reason,
)


def test_payload_uses_sglang_field_names():
    params = SamplingParams(max_new_tokens=8, temperature=0.5, top_k=4, stop_token_ids=(2,),
                            seed=9, n=3)
    body = generate_payload([1, 2], params, rid="r", return_logprob=True,
                            return_routed_experts=True)
    assert body["input_ids"] == [1, 2] and body["rid"] == "r"
    assert body["return_logprob"] is True and body["return_routed_experts"] is True
    sp = body["sampling_params"]
    assert sp["sampling_seed"] == 9 and "seed" not in sp and sp["stop_token_ids"] == [2]
    assert SamplingParams.from_sglang(sp) == params


def test_new_style_answer_with_routes():
    routes = np.arange(3 * 2 * 2, dtype=np.int32)
    answer = [{"text": "", "output_ids": [7, 8], "meta_info": {
        "id": "r-0", "finish_reason": {"type": "stop", "matched": 8},
        "output_token_logprobs": [[-0.5, 7, None], [-1.5, 8, None]], "weight_version": "3",
        "routed_experts": base64.b64encode(routes.tobytes()).decode(), "e2e_latency": 0.1}}]
    (s,) = decode_generate_answer(answer, [1, 2], prompt_index=4, layout=RoutedExpertsLayout(2, (0, 1), 2))
    assert (s.prompt_index, s.sample_index, s.response_ids) == (4, 0, [7, 8])
    assert s.log_probs == [-0.5, -1.5] and s.finish_reason == "stop" and s.matched_stop == 8
    assert s.weight_version == "3" and s.extra == {"e2e_latency": 0.1}
    assert s.routed_experts.dtype == torch.int16
    assert torch.equal(s.routed_experts, torch.arange(12, dtype=torch.int16).view(3, 2, 2))


def test_old_style_answer_is_tolerated():
    answer = {"text": "x", "meta_info": {"finish_reason": "length",
                                         "output_token_logprobs": [[-0.1, 5], [-0.2, 6]],
                                         "routed_experts": [[[1, 0]], [[0, 1]]]}}
    (s,) = decode_generate_answer(answer, [1], 0, layout=RoutedExpertsLayout(1, (0,), 2))
    assert s.response_ids == [5, 6] and s.finish_reason == "length"
    assert s.weight_version is None and s.routed_experts.tolist() == [[[1, 0]], [[0, 1]]]
    assert parse_finish_reason(None) == ("length", None)
    assert parse_finish_reason({"type": "abort", "message": "x"}) == ("abort", None)


def test_routes_of_every_layer_keep_the_moe_layers_rows():
    """SGLang sends a row for every layer (dense ones 0); the sample keeps the MoE layers'."""
    layout = RoutedExpertsLayout(num_layers=3, moe_layers=(0, 2), top_k=2)
    moe = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2) + 1
    wire = np.zeros((4, 3, 2), dtype=np.int32)
    wire[:, [0, 2]] = moe
    answer = {"output_ids": [7, 8], "meta_info": {
        "finish_reason": {"type": "length", "length": 2},
        "routed_experts": base64.b64encode(wire.tobytes()).decode()}}
    (s,) = decode_generate_answer(answer, [1, 2, 3], 0, layout=layout)
    assert s.routed_experts.dtype == torch.int16 and s.routed_experts.shape == (4, 2, 2)
    assert torch.equal(s.routed_experts, torch.from_numpy(moe).to(torch.int16))
    assert torch.equal(layout.all_layers(s.routed_experts).int(), torch.from_numpy(wire))
    with pytest.raises(ResponseFormatError, match="3 layers x 2 experts"):
        decode_generate_answer({"output_ids": [1], "meta_info": {
            "routed_experts": base64.b64encode(moe.tobytes()[:40]).decode()}}, [1], 0, layout)


def test_layout_from_qwen3_moe_and_deepseek_v3_configs():
    from megarl.config.model_info import model_info_from_dict

    base = {"num_hidden_layers": 4, "hidden_size": 8, "num_attention_heads": 2,
            "vocab_size": 10, "num_experts_per_tok": 2}
    qwen = model_info_from_dict({**base, "num_experts": 4, "mlp_only_layers": [1],
                                 "decoder_sparse_step": 1})
    deepseek = model_info_from_dict({**base, "n_routed_experts": 4, "first_k_dense_replace": 1,
                                     "moe_layer_freq": 1})
    dense = model_info_from_dict(base)
    assert RoutedExpertsLayout.from_model_info(qwen) == RoutedExpertsLayout(4, (0, 2, 3), 2)
    assert RoutedExpertsLayout.from_model_info(deepseek) == RoutedExpertsLayout(4, (1, 2, 3), 2)
    assert RoutedExpertsLayout.from_model_info(dense) is None


def test_undecodable_answers_say_what_is_missing():
    with pytest.raises(ResponseFormatError, match="output_ids"):
        decode_generate_answer({"meta_info": {"finish_reason": None}}, [1], 0)
    with pytest.raises(ResponseFormatError, match="routed_experts_layout"):
        decode_generate_answer({"output_ids": [1], "meta_info": {"routed_experts": "AAAA"}},
                               [1], 0)
    with pytest.raises(ResponseFormatError, match="unknown type"):
        parse_finish_reason({"type": "exploded"})


def test_sampling_params_validation_names_the_field():
    with pytest.raises(ValueError, match="sampling_params.top_k"):
        SamplingParams(top_k=0)
    with pytest.raises(ValueError, match="sampling_params.temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="not supported"):
        SamplingParams.from_sglang({"frequency_penalty": 0.5})
    with pytest.raises(ValueError, match="max_new_tokens: expected an integer"):
        SamplingParams.from_sglang({"max_new_tokens": "lots"})
    with pytest.raises(ValueError, match="stop_token_ids: expected a list"):
        SamplingParams.from_sglang({"stop_token_ids": [1, "x"]})
    assert SamplingParams.from_sglang({"top_k": -5, "skip_special_tokens": True,
                                       "stop": None}).top_k == -1
