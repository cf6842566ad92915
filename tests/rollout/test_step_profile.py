"""The embedded engine's step profile (``/get_server_info``'s ``step_profile``): the work and
seconds of its prefills and decode steps, which ``benchmarks/e2e_step.py`` uses to explain a
generation phase. The counts are checked against what the requests imply: a prompt prefilled
once for its ``n`` rows, one decode step per token after the first, and a finished row decoded
on (as wasted work) until the batch is compacted: at once on the native path."""

from __future__ import annotations

import pytest
import torch

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.interface import SamplingParams
from megarl.rollout.local.engine import LocalEngine, Request
from megarl.rollout.local.kv_cache import row_bucket
from megarl.rollout.local.model_runner import ModelRunner
from megarl.rollout.local.step_profile import StepProfile, profile_delta, profile_summary

PROMPT = 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("step_profile")
    return make_tiny_model(root / "model", arch="qwen3", seed=0, head_dim=64, hidden_size=128,
                           num_attention_heads=4, with_tokenizer=False)


def request(rid: str, n: int, new: int) -> Request:
    g = torch.Generator().manual_seed(len(rid))
    return Request(rid, torch.randint(3, 100, (PROMPT,), generator=g).tolist(),
                   SamplingParams(max_new_tokens=new, temperature=1.0, n=n, ignore_eos=True))


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_the_profile_counts_each_prefill_token_and_decoded_row(model_dir, backend):
    engine = LocalEngine(ModelRunner(model_dir, backend=backend), seed=0)
    first = engine.load_state()["step_profile"]
    # eight rows of 48 tokens and one of 24: the short one finishes at decode step 23
    reqs = [request("a", n=8, new=48), request("bb", n=1, new=24)]
    calls = []  # (rows, finished rows) of each decode call the runner gets
    real = engine.runner.decode

    def counted(tokens, *args, **kwargs):
        calls.append((len(tokens), sum(s.finish is not None for s in engine._rows)))
        return real(tokens, *args, **kwargs)

    engine.runner.decode = counted
    for r in reqs:
        engine._enqueue(r)
    while not all(r.future.done() for r in reqs):
        engine._step()
    assert [len(s.output_ids) for s in reqs[1].future.result()] == [24]
    delta = profile_delta(engine.load_state()["step_profile"], first)
    assert delta["prefill_steps"] == 1 and delta["prefill_rows"] == 9
    assert delta["prefill_tokens"] == 2 * PROMPT  # each prompt once, its KV copied to n rows
    assert delta["decode_steps"] == len(calls) == 47
    assert delta["decode_rows"] - delta["decode_finished_rows"] == 8 * 48 + 24 - 9
    assert delta["decode_rows"] == sum(rows for rows, _ in calls)
    assert delta["decode_finished_rows"] == sum(done for _, done in calls)
    # the native path drops a finished row at once; the HF path decodes it on (under a quarter)
    assert delta["decode_finished_rows"] == (0 if backend == "native" else 47 - 23)
    buckets = {}
    for rows, _ in calls:
        entry = buckets.setdefault(str(row_bucket(rows)), {"steps": 0, "rows": 0})
        entry["steps"] += 1
        entry["rows"] += rows
    assert {b: {"steps": e["steps"], "rows": e["rows"]} for b, e in delta["by_rows"].items()} \
        == buckets
    assert sum(e["s"] for e in delta["by_rows"].values()) == pytest.approx(delta["decode_s"])
    assert delta["prefill_s"] > 0 and delta["decode_s"] > 0
    flat = profile_summary(delta)
    assert flat["decode_rows_per_step"] == pytest.approx(delta["decode_rows"] / 47)
    assert flat["decode_finished_fraction"] == pytest.approx(
        delta["decode_finished_rows"] / delta["decode_rows"])
    assert flat["decode_ms_per_step"] == pytest.approx(1e3 * delta["decode_s"] / 47)
    assert sum(v for k, v in flat.items() if k.startswith("decode_steps@")) == 47


def test_a_delta_keeps_only_the_buckets_that_ran_between_the_snapshots():
    profile = StepProfile()
    profile.decode(rows=3, finished=1, seconds=0.5)
    profile.prefill(tokens=10, rows=2, seconds=0.25)
    before = profile.snapshot()
    profile.decode(rows=100, finished=0, seconds=2.0)
    profile.decode(rows=3, finished=0, seconds=1.0)
    profile.add("schedule_s", 0.125)
    delta = profile_delta(profile.snapshot(), before)
    assert delta["by_rows"] == {"4": {"steps": 1, "s": 1.0, "rows": 3},
                                "128": {"steps": 1, "s": 2.0, "rows": 100}}
    assert delta["decode_steps"] == 2 and delta["decode_rows"] == 103
    assert delta["decode_finished_rows"] == 0 and delta["prefill_tokens"] == 0
    assert delta["schedule_s"] == 0.125
    assert profile_delta(before, None)["by_rows"] == {"4": {"steps": 1, "s": 0.5, "rows": 3}}


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_requests_of_one_prompt_admitted_together_prefill_it_once(model_dir, backend):
    """A client that sends one request per sample (verl's agent loop, the e2e benchmark) gets
    the prompt prefilled once for all of them, as SGLang's radix cache does; each sample draws
    the tokens it draws when its request runs alone."""
    def make() -> list[Request]:
        same = [Request(f"s{j}", list(range(3, 3 + PROMPT)),
                        SamplingParams(max_new_tokens=8 + j, temperature=1.0, seed=j,
                                       ignore_eos=True)) for j in range(3)]
        return [*same, request("other", n=1, new=5)]

    engine = LocalEngine(ModelRunner(model_dir, backend=backend), seed=0, deterministic=True)
    together = make()
    for r in together:
        engine._enqueue(r)
    while not all(r.future.done() for r in together):
        engine._step()
    delta = profile_delta(engine.load_state()["step_profile"], None)
    assert delta["prefill_steps"] == 1 and delta["prefill_rows"] == 4
    assert delta["prefill_tokens"] == 2 * PROMPT  # the shared prompt once, the other once
    alone = LocalEngine(ModelRunner(model_dir, backend=backend), seed=0, deterministic=True)
    for r, mine in zip(make(), together):
        alone._enqueue(r)
        while not r.future.done():
            alone._step()
        got, want = mine.future.result()[0], r.future.result()[0]
        assert got.output_ids == want.output_ids and len(got.output_ids) == r.params.max_new_tokens
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert profile_delta(alone.load_state()["step_profile"], None)["prefill_tokens"] == 4 * PROMPT
