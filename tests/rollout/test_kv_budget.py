"""The embedded engine's KV budget (``--max-total-tokens``; on a GPU from
``--mem-fraction-static``, as SGLang sizes its pool): rows are admitted only while the KV cache
they need at their final lengths fits, nothing is dropped, and a prompt that could never fit is
refused with the reason. On the H200 the dense e2e shape's engine grew its cache past the device
(CUDA out of memory in the decode step, HTTP 500) before this budget existed. On the native path
each row holds the pages of its own length (kv_cache.PagedKVCache), so short rows run beside a
long one where a rectangle of rows x the longest would not fit."""

from __future__ import annotations

import argparse

import pytest
import torch

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.interface import SamplingParams
from megarl.rollout.local.engine import LocalEngine, Request
from megarl.rollout.local.kv_cache import PAGE_SIZE, PagedKVCache, PoolExhausted
from megarl.rollout.local.model_runner import ModelRunner
from megarl.rollout.local.server import build_parser, kv_token_budget
from megarl.rollout.local.static_kv import PrefillKV
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
    if backend == "native":  # one 64-token page a row, and the pool's scratch page
        budget = (3 + 1) * PAGE_SIZE  # three rows' pages at a time, of eight
    else:  # the padded batch
        budget = 3 * final
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


def test_short_rows_run_beside_a_long_one_in_the_pages_they_need(model_dir):
    """A long sample (8 pages at its end: the tiny model's 512 positions) and six short ones (1
    page each) all run at once in a budget of 15 pages with the scratch page: a rectangle of 7
    rows x the long one's length would need 56. Every sample runs to its length and the pool never holds more than the
    budget."""
    runner = ModelRunner(model_dir, backend="native")
    long_new = 8 * PAGE_SIZE - PROMPT
    budget = (8 + 6 + 1) * PAGE_SIZE
    engine = LocalEngine(runner, seed=0, max_total_tokens=budget)
    reqs = requests(1, n=1, new=long_new) + requests(3, n=2)
    held = []
    seen = drive(engine, reqs, lambda: held.append(runner.kv_allocated_tokens))
    assert max(seen) == 7
    assert max(held) <= budget
    assert [len(s.output_ids) for s in reqs[0].future.result()] == [long_new]
    for r in reqs[1:]:
        assert [len(s.output_ids) for s in r.future.result()] == [NEW, NEW]
    # one page fewer and one short row waits for the others to finish
    engine = LocalEngine(ModelRunner(model_dir, backend="native"), seed=0,
                         max_total_tokens=budget - PAGE_SIZE)
    assert max(drive(engine, requests(1, n=1, new=long_new) + requests(3, n=2),
                     lambda: None)) == 5


def cache(page_size: int = 4) -> PagedKVCache:
    return PagedKVCache(layers=2, kv_heads=2, head_dim=4, dtype=torch.float32,
                        device=torch.device("cpu"), page_size=page_size)


def test_paged_cache_counts_its_peak_and_gives_pages_back():
    kv = cache()
    assert kv.bytes_per_token == 2 * 2 * 2 * 4 * 4
    assert kv.peak_tokens(5, pool=None) == (5 + 1) * 4  # the pages and the scratch page
    assert kv.peak_tokens(5, pool=20) == (20 + 1) * 4  # a budget: the pool is allocated at it
    kv.ensure_pool(5)
    kv.ensure_table(3, 12)
    kv.add_rows([9, 4, 1])  # 3 + 1 + 1 pages
    assert kv.free_pages == 0 and kv.peak_tokens(5, pool=None) == 6 * 4
    # growing with live pages: the old pool (6 pages) and the new one (2 x 5 + 1) at once
    assert kv.peak_tokens(6, pool=None) == 6 * 4 + 11 * 4
    with pytest.raises(PoolExhausted, match="1 more KV pages; 0 are free"):
        kv.extend([1], [5])
    assert kv.row_pages[1] == [4]  # nothing taken
    kv.keep([2, 0])  # row 1's page goes back; rows move in the table, their K/V stays
    assert kv.free_pages == 1 and kv.row_pages == [[5], [1, 2, 3]]
    assert kv.table[:2, :3].tolist() == [[5, 0, 0], [1, 2, 3]] and not kv.table[2:].any()
    kv.extend([0], [5])  # row 0 (1 page) to 5 tokens: the free page
    assert kv.row_pages[0] == [5, 4] and kv.table[0, :2].tolist() == [5, 4]
    kv.clear()
    assert kv.free_pages == 5 and not kv.table.any()


def test_paged_cache_keeps_prefill_kv_and_page_ids_through_growth():
    """Prefill K/V written into pages reads back per row (gathered through the table) as it
    was written, also after the pool grew by copy."""
    kv = cache(page_size=3)
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([7, 2, 5])
    prefill = PrefillKV([torch.randn(3, 7, 2, 4, generator=g) for _ in range(2)],
                        [torch.randn(3, 7, 2, 4, generator=g) for _ in range(2)], lengths)
    kv.ensure_table(3, 7)
    kv.ensure_pool(6)
    kv.add_rows(lengths.tolist())
    kv.write(0, prefill, [0, 1, 2])

    def row_tokens(pool: torch.Tensor, row: int, n: int) -> torch.Tensor:
        return pool[kv.table[row].long()].flatten(0, 1)[:n]

    for layer in range(2):
        for row, n in enumerate(lengths.tolist()):
            assert torch.equal(row_tokens(kv.keys[layer], row, n), prefill.keys[layer][row, :n])
    before = [row_tokens(kv.values[1], row, n) for row, n in enumerate(lengths.tolist())]
    assert kv.ensure_pool(8)  # grows (to twice 6 pages), the live pages copied
    assert kv.pages_cap == 12 and kv.free_pages == 6
    for row, n in enumerate(lengths.tolist()):
        assert torch.equal(row_tokens(kv.values[1], row, n), before[row])


@pytest.mark.parametrize("chunk_bytes", [64 << 20, 40])  # 40 bytes: one token a gather
def test_prefill_rows_are_written_to_each_sample_row_without_expanding_them(monkeypatch,
                                                                          chunk_bytes):
    """A prompt's samples (repeated prefill rows) each get the prefill's K/V in their own
    pages, written straight from the prefill (in gathers of at most WRITE_CHUNK_BYTES of one
    layer): the same tokens as the prefill rows, for every layer, K and V."""
    import megarl.rollout.local.kv_cache as kv_cache_module

    monkeypatch.setattr(kv_cache_module, "WRITE_CHUNK_BYTES", chunk_bytes)
    kv = cache(page_size=3)
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([4, 6])
    prefill = PrefillKV([torch.randn(2, 6, 2, 4, generator=g) for _ in range(2)],
                        [torch.randn(2, 6, 2, 4, generator=g) for _ in range(2)], lengths)
    index = [1, 0, 1, 1, 0]  # a second prompt's three samples, the first one's two
    kv.ensure_table(5, 6)
    kv.ensure_pool(12)
    kv.add_rows(lengths[index].tolist())
    kv.write(0, prefill, index)
    for layer in range(2):
        for pools, new in ((kv.keys, prefill.keys), (kv.values, prefill.values)):
            for row, source in enumerate(index):
                n = int(lengths[source])
                got = pools[layer][kv.table[row].long()].flatten(0, 1)[:n]
                assert torch.equal(got, new[layer][source, :n])


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


def test_rows_that_may_stop_are_admitted_at_expected_lengths_and_retracted_when_short(model_dir):
    """Rows with a stop token count at prompt + 0.7 of max_new_tokens (3 of the 4 pages they
    may reach), so 4 rows join a pool of 12 pages where 3 would at their final lengths; none
    stops, so they run short at their fourth page: rows are retracted and run again later,
    and every sample's tokens equal a run without a budget (greedy)."""
    new = 4 * PAGE_SIZE - PROMPT

    def reqs(stop: list[int]):
        g = torch.Generator().manual_seed(1)
        return [Request(f"r{i}", torch.randint(3, 100, (PROMPT,), generator=g).tolist(),
                        SamplingParams(max_new_tokens=new, temperature=0.0, n=2, ignore_eos=True,
                                       stop_token_ids=stop))
                for i in range(3)]

    reference = reqs([])
    drive(LocalEngine(ModelRunner(model_dir, backend="native"), seed=0), reference, lambda: None)
    drawn = {t for r in reference for s in r.future.result() for t in s.output_ids}
    stop = [min(set(range(3, 128)) - drawn)]  # a stop token no row draws
    runner = ModelRunner(model_dir, backend="native")
    budget = (12 + 1) * PAGE_SIZE
    engine = LocalEngine(runner, seed=0, max_total_tokens=budget)
    got, held = reqs(stop), []
    seen = drive(engine, got, lambda: held.append(runner.kv_allocated_tokens))
    assert max(seen) == 4 and max(held) <= budget
    assert engine.admission.retractions >= 1
    assert engine.load_state()["kv_retractions"] == engine.admission.retractions
    for g, want in zip(got, reference):
        assert [s.output_ids for s in g.future.result()] == [
            s.output_ids for s in want.future.result()]
        assert all(s.finish_reason["type"] == "length" for s in g.future.result())


def test_the_pool_leaves_room_for_the_prefill_budget_and_the_decode_graphs():
    """activation_headroom on Qwen3-1.7B's shape (the dense e2e model): a 16,384-token prefill
    keeps all 28 layers' K/V (112 KiB a token) plus one layer's activations; the graphs of the
    buckets up to 512 rows keep fp32 logits (and the sampler's copy) of 151,936 tokens a row."""
    from types import SimpleNamespace

    from megarl.rollout.local.kv_cache import ROW_BUCKETS, activation_headroom

    dense = SimpleNamespace(hidden_size=2048, intermediate_size=6144, vocab_size=151_936)
    per_token = 28 * 2 * 8 * 128 * 2
    prefill = 16_384 * (per_token + (6 * 2048 + 3 * 6144) * 2)
    graphs = sum(ROW_BUCKETS) * 151_936 * 8
    assert activation_headroom(dense, per_token, 2, 16_384, 512, graphs=True) == prefill + graphs
    assert activation_headroom(dense, per_token, 2, 16_384, 512, graphs=False) == prefill
    small = sum(b for b in ROW_BUCKETS if b <= 64) * 151_936 * 8
    assert activation_headroom(dense, per_token, 2, 0, 50, graphs=True) == small
    # MoE: the widest MLP is top-k x the expert width (8 x 768), not the dense intermediate
    moe = SimpleNamespace(hidden_size=2048, intermediate_size=768, num_experts_per_tok=8,
                          moe_intermediate_size=768, vocab_size=151_936)
    assert activation_headroom(moe, 1000, 2, 100, 1, graphs=False) == 100 * (
        1000 + (6 * 2048 + 3 * 8 * 768) * 2)

