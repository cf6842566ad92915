"""The embedded engine survives a generation step that runs out of device memory: the rows are
retracted with their tokens, the KV cache is freed, the budgets shrink and the rows run again,
to the same tokens as without the failure; only repeated failures fail the requests, and then
``/generate`` answers 500 with the reason (on the H200 a colocated engine's decode ran out of
memory in step 2 and every request got a bare "Internal Server Error")."""

from __future__ import annotations

import httpx
import pytest
import torch

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.interface import SamplingParams
from megarl.rollout.local.engine import LocalEngine, Request
from megarl.rollout.local.engine_memory import OOM_RETRIES
from megarl.rollout.local.model_runner import ModelRunner

PROMPT, NEW = 24, 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_oom")
    return make_tiny_model(root / "model", arch="qwen3", seed=0, head_dim=64, hidden_size=128,
                           num_attention_heads=4, with_tokenizer=False)


def greedy_requests(tag: str) -> list[Request]:
    g = torch.Generator().manual_seed(3)
    return [Request(f"{tag}{i}", torch.randint(3, 100, (PROMPT + i,), generator=g).tolist(),
                    SamplingParams(max_new_tokens=NEW, temperature=0.0, n=2, ignore_eos=True))
            for i in range(3)]


def run(engine: LocalEngine, requests: list[Request]) -> list[list]:
    """The engine's steps on this thread (as its loop runs them) until every request resolved."""
    for r in requests:
        engine._enqueue(r)
    for _ in range(1000):
        if all(r.future.done() for r in requests):
            return [r.future.result() for r in requests]
        engine._guarded_step()
    raise AssertionError("the engine did not finish its requests")


class OutOfMemoryOnce:
    """Wraps a runner method: its ``at``-th call raises torch.OutOfMemoryError, once."""

    def __init__(self, fn, at: int) -> None:
        self.fn, self.at, self.calls, self.raised = fn, at, 0, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("method, at", [("decode", 5), ("append_rows", 1)])
def test_a_step_out_of_memory_is_retracted_and_the_tokens_are_the_same(model_dir, method, at):
    """``decode``: rows running mid-way; ``append_rows``: a prefill whose first tokens were drawn
    and whose KV could not be added (the cache growing). Greedy, so the tokens must equal a run
    without the failure; the KV budget shrinks to 3/4 of what the cache held."""
    budget = 10_000
    reference = run(LocalEngine(ModelRunner(model_dir, backend="native"), seed=0,
                                max_total_tokens=budget), greedy_requests("a"))
    runner = ModelRunner(model_dir, backend="native")
    engine = LocalEngine(runner, seed=0, max_total_tokens=budget)
    held = []
    wrapped = OutOfMemoryOnce(getattr(runner, method), at)

    def failing(*args, **kwargs):
        held.append(runner.kv_allocated_tokens)
        return wrapped(*args, **kwargs)

    setattr(runner, method, failing)
    results = run(engine, greedy_requests("b"))
    assert wrapped.raised == 1 and engine.oom_recoveries == 1
    for got, want in zip(results, reference):
        assert [s.output_ids for s in got] == [s.output_ids for s in want]
        for g, w in zip(got, want):
            assert len(g.output_ids) == NEW and g.finish_reason["type"] == "length"
            assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4)
    at_failure = held[at - 1]
    assert at_failure > 0
    assert engine.max_total_tokens == at_failure * 3 // 4
    assert engine.load_state()["oom_recoveries"] == 1


def test_a_prefill_out_of_memory_keeps_the_running_rows_and_halves_the_prefill_budget(model_dir):
    """A prefill's forward that runs out of memory (activations beside a full KV pool, as on an
    H100 in the dense e2e step) retracts nothing: its prompts wait again, the prefill budget
    halves, and the rows that were decoding go on with their pages; the tokens are those of a
    run without the failure."""
    budget = 10_000
    reference = run(LocalEngine(ModelRunner(model_dir, backend="native"), seed=0,
                                max_total_tokens=budget), greedy_requests("a"))
    runner = ModelRunner(model_dir, backend="native")
    engine = LocalEngine(runner, seed=0, max_total_tokens=budget, max_prefill_tokens=1024)
    wrapped = OutOfMemoryOnce(runner.prefill, 2)  # the second prompt's prefill
    runner.prefill = wrapped
    first, *rest = greedy_requests("b")
    engine._enqueue(first)
    for _ in range(3):
        engine._guarded_step()
    running, held = [s.output_ids[:] for s in engine._rows], runner.kv_allocated_tokens
    assert len(running) == 2 and held > 0
    for r in rest:
        engine._enqueue(r)
    engine._guarded_step()  # the prefill fails; the two rows do not decode this step
    assert wrapped.raised == 1 and engine.oom_recoveries == 1
    assert [s.output_ids for s in engine._rows] == running  # still running, tokens kept
    assert runner.kv_allocated_tokens == held and engine.max_total_tokens == budget
    assert engine.max_prefill_tokens == 512 and len(engine._waiting) == 2
    for _ in range(1000):  # the rest of the steps
        if all(r.future.done() for r in (first, *rest)):
            break
        engine._guarded_step()
    results = [r.future.result(timeout=0) for r in (first, *rest)]
    for got, want in zip(results, reference):
        assert [s.output_ids for s in got] == [s.output_ids for s in want]
    engine.release_memory(["kv_cache"])  # the cut budget comes back with the next pool
    assert engine.max_prefill_tokens == 1024


def test_repeated_failures_fail_the_requests_after_the_retries(model_dir):
    runner = ModelRunner(model_dir, backend="native")
    engine = LocalEngine(runner, seed=0, max_total_tokens=10_000)
    calls = []

    def always(*args, **kwargs):
        calls.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    runner.decode = always
    requests = greedy_requests("c")
    for r in requests:
        engine._enqueue(r)
    for _ in range(100):
        if all(r.future.done() for r in requests):
            break
        engine._guarded_step()
    assert len(calls) == OOM_RETRIES + 1
    for r in requests:
        with pytest.raises(torch.OutOfMemoryError):
            r.future.result()
    assert not engine.busy


def test_generate_answers_500_with_the_reason(decode_oom_server):
    answer = httpx.post(decode_oom_server.url + "/generate", timeout=60, json={
        "input_ids": list(range(3, 20)), "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}})
    assert answer.status_code == 500, answer.text
    message = answer.json()["error"]["message"]
    assert message.startswith("generation failed: OutOfMemoryError: CUDA out of memory "
                              "(MEGARL_OOM_AT=engine_decode)")
    assert f"retried {OOM_RETRIES} times" in message and "free of" in message
    info = httpx.get(decode_oom_server.url + "/get_server_info").json()["internal_states"][0]
    assert info["oom_recoveries"] == OOM_RETRIES
