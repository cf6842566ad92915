"""Parsing SGLang /generate bodies into engine requests (batches, per-item fields, limits)."""

from __future__ import annotations

import pytest

from megarl.rollout.local.protocol import BadRequest, Limits, NormalizeError, parse_generate

MOE = Limits(vocab_size=128, context_length=64, has_router=True)
DENSE = Limits(vocab_size=128, context_length=64, has_router=False)


def test_batch_with_per_prompt_fields():
    body = {"input_ids": [[1, 2], [3]], "rid": ["a", "b"],
            "sampling_params": [{"max_new_tokens": 4}, {"max_new_tokens": 9}],
            "return_logprob": True}
    requests, as_list = parse_generate(body, MOE)
    assert as_list and [r.rid for r in requests] == ["a", "b"]
    assert [r.params.max_new_tokens for r in requests] == [4, 9]
    assert all(r.return_logprob for r in requests)


def test_a_batch_asking_for_different_n_is_refused_as_sglang_does():
    body = {"input_ids": [[1, 2], [3]],
            "sampling_params": [{"max_new_tokens": 4}, {"max_new_tokens": 9, "n": 2}]}
    with pytest.raises(NormalizeError, match="parallel_sample_num should be the same"):
        parse_generate(body, MOE)
    same = {**body, "sampling_params": [{"n": 2}, {"n": 2, "max_new_tokens": 3}]}
    assert [r.params.n for r in parse_generate(same, MOE)[0]] == [2, 2]


def test_samples_of_an_n_request_get_fresh_rids_and_the_parent_rid_names_none():
    (one,), _ = parse_generate({"input_ids": [1], "rid": "p"}, MOE)
    assert one.sample_rids == ["p"]
    (many,), _ = parse_generate({"input_ids": [1], "rid": "p", "sampling_params": {"n": 3}},
                                MOE)
    assert len(set(many.sample_rids)) == 3 and "p" not in many.sample_rids


def test_single_prompt_answers_an_object_unless_n_is_above_one():
    assert parse_generate({"input_ids": [1]}, MOE)[1] is False
    assert parse_generate({"input_ids": [1], "sampling_params": {"n": 3}}, MOE)[1] is True


def test_rejections_name_the_field():
    cases = [
        ({"input_ids": [[1], [2]], "rid": ["a"]}, "rid"),
        ({"input_ids": [1], "return_routed_experts": True}, "no MoE router"),
        ({"input_ids": [1], "logprob_start_len": 0}, "logprob_start_len"),
        ({"input_ids": [1], "routed_experts_start_len": -1}, "routed_experts_start_len"),
        ({"input_ids": [1], "text": "x"}, "exactly one"),
        ({"input_ids": [[]]}, "empty"),
        ({"input_ids": "12"}, "input_ids"),
    ]
    for body, needle in cases:
        with pytest.raises(BadRequest, match=needle):
            parse_generate(body, DENSE)
