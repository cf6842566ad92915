"""The embedded engine's KV budget (``--max-total-tokens``; on a GPU from
``--mem-fraction-static``, as SGLang sizes its pool): rows are admitted only while the KV cache
they need at their final lengths fits, nothing is dropped, and a prompt that could never fit is
refused with the reason. On the H200 the dense e2e shape's engine grew its cache past the device
(CUDA out of memory in the decode step, HTTP 500) before this budget existed."""

from __future__ import annotations

import argparse

import pytest
import torch

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.interface import SamplingParams
from megarl.rollout.local.engine import LocalEngine, Request
from megarl.rollout.local.kv_cache import LENGTH_STEP, StaticKVCache, row_bucket
from megarl.rollout.local.model_runner import ModelRunner
from megarl.rollout.local.server import build_parser, kv_token_budget
from megarl.rollout.server_worker import EngineSpec, engine_command

PROMPT, NEW = 40, 24  # final length 64 per row


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv_budget")
    return make_tiny_model(root / "model", arch="qwen3", seed=0, head_dim=64, hidden_size=128,
                           num_attention_heads=4, with_tokenizer=False)


def drive(engine: LocalEngine, requests: list[Request], watch) -> list[int]:
    """Run the engine's steps on this thread until every request resolved; ``watch()`` after
    each step. Returns the running rows seen after each step."""
    for r in requests:
        engine._enqueue(r)
    seen = []
    for _ in range(10_000):
        if all(r.future.done() for r in requests):
            return seen
        engine._step()
        seen.append(sum(s.finish is None for s in engine._rows))
        watch()
    raise AssertionError("the engine did not finish its requests")


def requests(count: int, n: int = 2, new: int = NEW) -> list[Request]:
    g = torch.Generator().manual_seed(1)
    return [Request(f"r{i}", torch.randint(3, 100, (PROMPT,), generator=g).tolist(),
                    SamplingParams(max_new_tokens=new, temperature=1.0, n=n, ignore_eos=True))
            for i in range(count)]


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_rows_are_admitted_while_their_kv_fits(model_dir, backend):
    runner = ModelRunner(model_dir, backend=backend)
    final = PROMPT + NEW
    if backend == "native":  # the static cache: rows x (final + 1 scratch, in 256-token steps)
        per_row = -(-(final + 2) // LENGTH_STEP) * LENGTH_STEP
    else:  # the padded batch
        per_row = final
    budget = 3 * per_row  # three rows at a time, of eight
    engine = LocalEngine(runner, seed=0, max_total_tokens=budget)
    peaks = []

    def watch():
        if runner.native is not None:
            peaks.append(runner.native.cache.allocated_tokens)

    reqs = requests(4)
    seen = drive(engine, reqs, watch)
    for r in reqs:  # nothing dropped: every sample ran to its length
        results = r.future.result()
        assert [len(s.output_ids) for s in results] == [NEW, NEW]
        assert all(s.finish_reason["type"] == "length" for s in results)
    assert max(seen) == 2  # one prompt (n=2) at a time: a second would need 4 rows
    if backend == "native":
        assert 0 < max(peaks) <= budget
    unbounded = LocalEngine(ModelRunner(model_dir, backend=backend), seed=0)
    assert max(drive(unbounded, requests(4), lambda: None)) == 8  # all at once without it


def test_a_prompt_that_can_never_fit_is_refused_and_the_rest_run(model_dir):
    runner = ModelRunner(model_dir, backend="hf")
    engine = LocalEngine(runner, seed=0, max_total_tokens=2 * (PROMPT + NEW))
    big = requests(1, n=3)[0]  # 3 rows of 64 tokens: 192 slots, more than the 128 there are
    small = requests(2, n=2)[1]
    drive(engine, [big, small], lambda: None)
    refused = big.future.result()
    assert all(s.finish_reason["type"] == "abort" for s in refused)
    message = refused[0].finish_reason["message"]
    assert "192" in message and "128" in message and "--max-total-tokens" in message
    assert [len(s.output_ids) for s in small.future.result()] == [NEW, NEW]


def test_static_cache_peak_counts_the_copy_when_it_grows():
    cache = StaticKVCache(layers=2, kv_heads=2, head_dim=4, dtype=torch.float32,
                          device=torch.device("cpu"))
    assert cache.bytes_per_token == 2 * 2 * 2 * 4 * 4
    assert cache.peak_tokens(3, 100, live_rows=0) == row_bucket(3) * LENGTH_STEP
    cache.ensure(3, 100, live_rows=0)
    assert cache.allocated_tokens == 4 * 256
    assert cache.peak_tokens(4, 200, live_rows=3) == 4 * 256  # fits: nothing new
    # growing with live rows: old 4 x 256 and new 8 x 512 (length doubles) at once
    assert cache.peak_tokens(5, 300, live_rows=3) == 4 * 256 + 8 * 512
    # with no live row the old buffers go first
    assert cache.peak_tokens(5, 300, live_rows=0) == 8 * 512
    cache.ensure(5, 300, live_rows=0)
    assert (cache.rows_cap, cache.len_cap) == (8, 512)


def test_the_budget_comes_from_the_flags(model_dir):
    runner = ModelRunner(model_dir, backend="hf")
    args = build_parser().parse_args(["--model", str(model_dir), "--max-total-tokens", "5000"])
    assert kv_token_budget(args, runner) == 5000
    args = build_parser().parse_args(["--model", str(model_dir), "--mem-fraction-static", "0.5"])
    assert kv_token_budget(args, runner) is None  # the CPU: no device memory to divide
    with pytest.raises(ValueError, match="--max-total-tokens 0"):
        kv_token_budget(argparse.Namespace(max_total_tokens=0), runner)
    # 2 layers x (k, v) x kv heads x head_dim x 4 bytes (fp32)
    cfg = runner.config
    assert runner.kv_bytes_per_token == (2 * cfg.num_hidden_layers * cfg.num_key_value_heads
                                         * cfg.head_dim * 4)


def test_rollout_gpu_memory_utilization_reaches_the_embedded_engine_on_a_gpu(tmp_path):
    spec = EngineSpec(backend="local", model_path="/m", mem_fraction=0.55,
                      log_dir=str(tmp_path))
    argv = engine_command(spec, rank=0, port=9, device="cuda")
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.55"
    assert "--mem-fraction-static" not in engine_command(spec, rank=0, port=9, device="cpu")
