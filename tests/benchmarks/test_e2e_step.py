"""``benchmarks/e2e_step.py``: the forced response lengths, and its ``--smoke`` run (megarl's real
colocated-step stack, then TRL's GRPOTrainer as a second command on the same tiny model, prompts
and lengths)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from tests.benchmarks.test_smoke import ROOT, load


def test_forced_lengths_are_deterministic_and_long_tailed():
    bench = load("e2e_step")
    prompts = [[7 + i % 50, 9, 11 + i] for i in range(250)]
    lengths = [bench.response_length(p, j, 512.0, 0.8, 2048) for p in prompts for j in range(8)]
    assert lengths == [bench.response_length(p, j, 512.0, 0.8, 2048)
                       for p in prompts for j in range(8)]
    assert 440 < statistics.median(lengths) < 590  # log-normal median 512
    assert max(lengths) == 2048 and min(lengths) >= 1  # capped; the tail reaches the cap
    assert statistics.mean(lengths) > statistics.median(lengths) * 1.15  # long right tail
    # the samples of one group differ: the key includes the sample's index
    assert len({bench.response_length(prompts[0], j, 512.0, 0.8, 2048) for j in range(8)}) > 4


def test_the_shapes_hold_the_longest_default_sequence():
    """The H200 shapes' context covers a default prompt plus the longest forced response: with
    the tiny models' 512 positions the engine cut every response at the context, and the run
    measured 134-token answers while reporting 651 (caught by the summary's error since)."""
    bench = load("e2e_step")
    args = bench.parse([])
    longest = args.prompt_len[1] + args.max_response
    for name, shape in bench.SHAPES.items():
        assert shape["max_position_embeddings"] >= longest, name


def test_a_run_whose_engine_cut_the_responses_is_reported_as_wrong(tmp_path):
    from megarl.data.tiny_model import make_tiny_model

    bench = load("e2e_step")
    args = bench.parse(["--smoke", "--device", "cpu"])
    model = make_tiny_model(tmp_path / "model", arch="qwen3")
    prompts = [[5, 6, 7], [8, 9]]
    forced = [bench.response_length(p, j, args.median, args.sigma, args.max_response)
              for p in prompts for j in range(args.n)]
    metrics = {"response_length/mean": sum(forced) / len(forced) / 2, "timing/gen": 1.0,
               "timing/old_log_prob": 1.0, "timing/update_actor": 1.0,
               "timing/sync_weights": 1.0}
    floors = {"copy_bytes_per_s": 1e9, "matmul_flops": 1e12}
    run = {"walls": [5.0], "metrics": [metrics]}
    out = bench.summarize(args, model, prompts, floors, run, {"skipped": "--trl off"})
    assert "the engine cut them" in out["error"]
    metrics["response_length/mean"] = sum(forced) / len(forced)
    out = bench.summarize(args, model, prompts, floors, run, {"skipped": "--trl off"})
    assert "error" not in out


def _moe_card(root):
    """The MoE shape's config.json and tokenizer."""
    return _card(root, "moe")


def _card(root, shape):
    """A shape's config.json and tokenizer (no weights: estimates need only the card)."""
    from transformers import AutoConfig

    from megarl.data.tiny_model import build_tokenizer, tiny_config_dict

    bench = load("e2e_step")
    dims = dict(bench.SHAPES[shape])
    arch = dims.pop("arch")
    fields = tiny_config_dict(arch, **dims)
    AutoConfig.for_model(fields.pop("model_type", arch), **fields).save_pretrained(root)
    build_tokenizer(dims["vocab_size"]).save_pretrained(root)
    return bench


@pytest.mark.parametrize("shape, device_gib, chosen", [
    # without recompute, the optimizer state off the GPU through forwards and backwards (the
    # colocated default): dense ~42 GiB, the MoE slice's step ~94 GiB
    ("dense", 139.8, "none"),  # fits an H200's 70%
    ("dense", 79.2, "none"),   # and an H100's
    ("dense", 48.0, "full"),   # not a 48 GB card's
    ("moe", 139.8, "none"),    # 94 of 97.9 GiB
    ("moe", 79.2, "full"),     # not an H100's (nor would anything: the state is 94 GiB)
])
def test_recompute_auto_keeps_activations_where_the_estimate_fits(tmp_path, shape, device_gib,
                                                                   chosen):
    """``--recompute auto`` (the default) decides from megarl's estimate of the update without
    recompute against the device's memory; other values pass through, and off CUDA auto is
    full."""
    from megarl.demo import DEMOS

    bench = _card(tmp_path, shape)
    args = bench.parse([])
    assert args.recompute == "auto"
    data = tmp_path / "prompts.jsonl"
    data.write_text("")
    overrides = [f"model.path={tmp_path}", f"data.train_files=[{data}]",
                 f"data.val_files=[{data}]", f"data.train_batch_size={args.prompts}",
                 f"rollout.n={args.n}", f"actor.ppo_mini_batch_size={args.prompts}",
                 "actor.parallel.ep=1", f"data.max_prompt_length={args.prompt_len[1]}",
                 f"data.max_response_length={args.max_response}", "model.dtype=bfloat16"]
    samples = args.prompts * args.n
    gib = int(device_gib * 2**30)
    assert bench.resolve_recompute(args, DEMOS["cuda"].config, overrides, samples, gib) == chosen
    assert bench.resolve_recompute(args, DEMOS["cuda"].config, overrides, samples, None) == "full"
    args.recompute = "selective"
    assert bench.resolve_recompute(args, DEMOS["cuda"].config, overrides, samples, gib) == \
        "selective"


@pytest.mark.parametrize("knobs, refused", [
    ([], False),  # the benchmark's defaults on an H200: 16k-token micro-batches, full recompute
    (["--micro-batch-tokens", "0", "--micro-batches", "8", "--recompute", "none"], True),
])
def test_the_device_preflight_passes_the_defaults_and_refuses_what_cannot_fit(tmp_path, knobs,
                                                                               refused):
    """On a free H200 (139.8 GB of 141): the MoE shape at the benchmark's defaults fits every
    phase; with recompute off and 64-sequence micro-batches its update's forwards and
    backwards are refused before any worker starts, with a line naming the phase and the
    knobs (32-sequence ones, ~114 GB, fit now that the optimizer state is off the GPU then)."""
    from megarl.config import load_config
    from megarl.config.model_info import load_model_info
    from megarl.demo import DEMOS
    from megarl.memory_preflight import device_preflight

    bench = _moe_card(tmp_path)
    args = bench.parse(knobs)
    data = tmp_path / "prompts.jsonl"
    data.write_text("")
    samples = args.prompts * args.n
    cfg, _ = load_config(str(DEMOS["cuda"].config), [
        f"model.path={tmp_path}", f"data.train_files=[{data}]", f"data.val_files=[{data}]",
        f"data.train_batch_size={args.prompts}", f"rollout.n={args.n}",
        f"actor.ppo_mini_batch_size={args.prompts}", "actor.parallel.ep=1",
        f"data.max_prompt_length={args.prompt_len[1]}",
        f"data.max_response_length={args.max_response}", "model.dtype=bfloat16",
        *bench.micro_batch_overrides(args, samples, "full" if args.recompute == "auto"
                                     else args.recompute)])
    h200 = {"GPU 0": (int(139.8 * 2**30), int(140.4 * 2**30))}
    lines, refused_now = device_preflight(cfg, load_model_info(str(tmp_path)), read=lambda: h200)
    assert refused_now == refused, lines
    if refused:
        assert lines[0].startswith("preflight: phase 'update_actor' needs ~") and (
            "actor.recompute.granularity" in lines[0])
    else:
        assert lines[0].startswith("preflight: every phase fits")


@pytest.mark.timeout(400)
def test_the_json_is_written_before_the_teardown_and_trl_runs_as_a_second_command(tmp_path):
    """At the e2e sizes the teardown (engines, Ray, pinned host memory) can outlast a time limit:
    the figures are on disk as soon as the timed steps end. Here the teardown fails after
    stopping everything (MEGARL_FAIL_AT=after_close): the run exits non-zero, the JSON holds the
    shape's figures. Then TRL's side runs alone (--megarl off) and the report holds both."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "MEGARL_FAIL_AT": "after_close"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "e2e_step.py"), "--smoke",
                           "--shape", "moe", "--trl", "off", "--out", str(tmp_path)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          check=False)
    assert proc.returncode != 0 and "after_close: injected failure" in proc.stderr, (
        proc.stdout[-2000:] + proc.stderr[-2000:])
    r = json.loads((tmp_path / "e2e_step.json").read_text())["results"]["moe"]
    assert r["step_s"] > 0 and r["gen_s"] > 0 and r["trained_response_length"] > 0
    # each phase's estimate (as `megarl config show` gives it) against the actor's logged peak;
    # the CPU smoke's engine has a pool of its own, so none of its weights is added to the sync
    stored = json.loads((tmp_path / "moe" / "megarl" / "estimates.json").read_text())
    assert stored["colocated"] is False
    for phase in ("old_log_prob", "update_actor", "sync_weights"):
        e = r["memory_estimates"][phase]
        assert e["estimate_gb"] == stored["estimates_gb"][phase] > 0
        assert e["measured_gb"] == r["memory_gb"][f"max_memory_allocated_gb/{phase}"] > 0
        assert e["ratio"] == pytest.approx(e["estimate_gb"] / e["measured_gb"])
    assert (tmp_path / "moe" / "megarl" / "steps.jsonl").read_text().count("\n") == 2  # warm-up + 1
    # the engine's profile of the timed step's generation: every sample is a request of its own
    # (a prompt prefilled once for those of its requests admitted together), its first token
    # drawn by the prefill and each later one by a decode step
    bench = load("e2e_step")
    prompts = [json.loads(line)["input_ids"]
               for line in (tmp_path / "moe" / "prompts.jsonl").read_text().splitlines()]
    forced = [bench.response_length(p, j, 6.0, 0.8, 16) for p in prompts for j in range(2)]
    prof = r["gen_profile"]
    assert prof["prefill_rows"] == len(forced)
    assert sum(len(p) for p in prompts) <= prof["prefill_tokens"] <= 2 * sum(len(p) for p in prompts)
    assert prof["decode_rows"] - prof["decode_finished_rows"] == sum(forced) - len(forced)
    assert prof["decode_steps"] >= max(forced) - 1
    assert sum(v for k, v in prof.items() if k.startswith("decode_steps@")) == prof["decode_steps"]
    assert 0 < prof["prefill_s"] + prof["decode_s"] < r["gen_s"]
    pytest.importorskip("trl")
    env.pop("MEGARL_FAIL_AT")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "e2e_step.py"), "--smoke",
                           "--shape", "moe", "--megarl", "off", "--trl-prompts", "3",
                           "--trl-generation-batch", "2", "--out", str(tmp_path)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "e2e_step.json").read_text())
    both = report["results"]["moe"]
    assert both["step_s"] == r["step_s"] and both["gen_s"] == r["gen_s"]  # megarl's, as measured
    assert both["response_tokens"] == sum(forced)
    # megarl trained exactly the forced lengths; TRL generated them plus its EOS
    assert both["trained_response_length"] == pytest.approx(sum(forced) / len(forced), abs=1e-9)
    # TRL's step ran the first 3 of the 4 prompts (--trl-prompts 3): their forced lengths + EOS
    trl_forced = forced[:3 * 2]
    # three HF generate calls of one group each (--trl-generation-batch 2)
    assert both["trl_prompts"] == 3 and both["trl_generation_batch"] == 2
    assert both["trl_mean_completion_length"] == pytest.approx(
        sum(trl_forced) / len(trl_forced) + 1, abs=1e-3)
    assert both["trl_expected_completion_length"] == pytest.approx(
        sum(trl_forced) / len(trl_forced) + 1)
    for phase in ("gen_s", "old_log_prob_s", "update_actor_s", "sync_s", "step_s", "trl_step_s"):
        assert both[phase] > 0, phase
    trl_tokens = sum(trl_forced) + 2 * sum(len(p) for p in prompts[:3])
    assert both["trl_tokens_per_s"] == pytest.approx(trl_tokens / both["trl_step_s"])
    assert both["megarl_over_trl"] == pytest.approx(
        both["tokens"] / both["step_s"] / both["trl_tokens_per_s"])
    assert both["trl_step_s_all_prompts"] == pytest.approx(
        both["trl_step_s"] * both["tokens"] / trl_tokens)
    assert 0 < both["gen_floor_fraction"] and 0 < both["update_actor_mfu"] < 1
    # the CPU smoke runs separate pools: no release/resume, and the report says so
    assert "timing/release_rollout" in both["phases_not_run"]
    assert report["floors"]["matmul_flops"] > 0 and report["floors"]["copy_bytes_per_s"] > 0
    assert (tmp_path / "e2e_step.png").stat().st_size > 10_000
    # R3 (issue 30): megarl's side again with the engine's routes replayed, reported as moe_r3
    # next to moe, with the throughput it costs against it
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "e2e_step.py"), "--smoke",
                           "--shape", "moe", "--trl", "off", "--router-replay", "R3",
                           "--out", str(tmp_path)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "e2e_step.json").read_text())
    assert report["results"]["moe"] == both  # the run without R3 stays as it was
    r3 = report["results"]["moe_r3"]
    assert r3["response_tokens"] == both["response_tokens"]  # the same forced lengths
    assert r3["r3_throughput_ratio"] == pytest.approx(r3["step_tokens_per_s"]
                                                      / both["step_tokens_per_s"])
    assert r3["r3_cost"] == pytest.approx(1 - r3["r3_throughput_ratio"])
    assert report["by_shape"]["moe_r3"]["settings"]["router_replay"] == "R3"
    # the R3 run replayed the engine's routes (agreement 1); the other one asked for none
    rows = [json.loads(line) for line in
            (tmp_path / "moe" / "megarl_r3" / "steps.jsonl").read_text().splitlines()]
    assert [row["rollout/moe/router_agreement"] for row in rows] == [1.0, 1.0]
    rows = (tmp_path / "moe" / "megarl" / "steps.jsonl").read_text()
    assert "router_agreement" not in rows


def test_router_replay_needs_the_moe_shape_and_megarl_alone(capsys):
    bench = load("e2e_step")
    for argv, says in ((["--shape", "dense", "--router-replay", "R3", "--trl", "off"],
                        "needs --shape moe (got --shape dense)"),
                       (["--shape", "moe", "--router-replay", "R3"], "add --trl off")):
        with pytest.raises(SystemExit):
            bench.parse(argv)
        assert says in capsys.readouterr().err


def test_r3_cost_is_the_throughput_lost_against_the_run_without_r3(tmp_path):
    bench = load("e2e_step")
    args = bench.parse(["--shape", "moe", "--out", str(tmp_path), "--trl", "off"])
    base = {"step_s": 10.0, "step_tokens_per_s": 1000.0, "gen_s": 4.0, "old_log_prob_s": 1.0,
            "update_actor_s": 3.0, "sync_s": 0.5}
    bench.write_json(args, {}, {"moe": base})
    r3_args = bench.parse(["--shape", "moe", "--out", str(tmp_path), "--trl", "off",
                           "--router-replay", "R3"])
    slower = {**base, "step_s": 10.5, "step_tokens_per_s": 1000.0 / 1.05, "gen_s": 4.2}
    every = bench.write_json(r3_args, {}, {"moe_r3": slower})
    assert every["moe_r3"]["r3_throughput_ratio"] == pytest.approx(1 / 1.05)
    assert every["moe_r3"]["r3_cost"] == pytest.approx(0.05 / 1.05)
    assert every["moe_r3"]["r3_phase_ratios"]["gen_s"] == pytest.approx(1.05)
    assert every["moe_r3"]["r3_phase_ratios"]["update_actor_s"] == 1.0
    assert "r3_cost" not in every["moe"]


def test_the_json_keeps_the_shapes_of_earlier_runs_into_the_same_out(tmp_path):
    """One shape per command (the device's call limit): the second run's JSON holds both shapes,
    each with the settings it ran under; a shape run again replaces its own entry only."""
    bench = load("e2e_step")
    moe_args = bench.parse(["--shape", "moe", "--out", str(tmp_path), "--moe-layers", "8"])
    every = bench.write_json(moe_args, {"matmul_flops": 1.0}, {"moe": {"step_s": 70.0}})
    assert every == {"moe": {"step_s": 70.0}}
    dense_args = bench.parse(["--shape", "dense", "--out", str(tmp_path), "--prompts", "32"])
    every = bench.write_json(dense_args, {"matmul_flops": 2.0}, {"dense": {"step_s": 88.0}})
    assert every == {"moe": {"step_s": 70.0}, "dense": {"step_s": 88.0}}
    report = json.loads((tmp_path / "e2e_step.json").read_text())
    assert report["results"] == every
    assert report["by_shape"]["moe"]["settings"]["shape"] == "moe"
    assert report["by_shape"]["moe"]["floors"] == {"matmul_flops": 1.0}
    assert report["by_shape"]["dense"]["settings"]["prompts"] == 32
    bench.write_json(moe_args, {"matmul_flops": 3.0}, {"moe": {"step_s": 71.0}})
    report = json.loads((tmp_path / "e2e_step.json").read_text())
    assert report["results"] == {"moe": {"step_s": 71.0}, "dense": {"step_s": 88.0}}
    assert report["by_shape"]["moe"]["floors"] == {"matmul_flops": 3.0}
    assert report["by_shape"]["dense"]["floors"] == {"matmul_flops": 2.0}


def test_estimates_are_held_against_the_peaks_of_their_phases(tmp_path):
    """A colocated run: the sync's estimate counts the engine's weights, so its measured side
    is the actor's peak plus those; the others are the actor's peaks alone; 25% either way is
    within the bound; generation's estimate has no measured side in the actor's metrics.
    (The numbers: the H200's MoE run of 2026-12-05.)"""
    from benchmarks.e2e_memory import GIB, compare_estimates

    path = tmp_path / "estimates.json"
    path.write_text(json.dumps({"estimates_gb": {"gen": 120.0, "old_log_prob": 12.73,
                                                 "update_actor": 98.59, "sync_weights": 21.14},
                                "colocated": True}))
    memory = {"max_memory_allocated_gb/old_log_prob": 12.82,
              "max_memory_allocated_gb/update_actor": 112.2,
              "max_memory_allocated_gb/sync_weights": 11.79, "device_used_gb": 120.9}
    got = compare_estimates(path, memory, engine_weight_bytes=int(10.44 * GIB))
    assert got["sync_weights"]["measured_gb"] == pytest.approx(11.79 + 10.44)
    assert got["sync_weights"]["ratio"] == pytest.approx(21.14 / 22.23)
    assert got["update_actor"]["ratio"] == pytest.approx(98.59 / 112.2)
    assert all(got[p]["within_bound"] for p in ("old_log_prob", "update_actor", "sync_weights"))
    assert got["gen"]["measured_gb"] is None
    memory["max_memory_allocated_gb/update_actor"] = 98.59 / 0.74  # 26% under: out of bound
    assert not compare_estimates(path, memory, 0)["update_actor"]["within_bound"]
    assert compare_estimates(tmp_path / "missing.json", memory, 0) == {}


def test_trl_generates_in_batches_whose_kv_cache_fits():
    """TRL's default generates every sample of the step in one HF ``generate`` call: 512 rows x
    2,561 tokens of KV cache is 150 GB for the dense shape. The benchmark splits it into the
    largest batch TRL accepts (a divisor of the step's samples, a multiple of the micro-batch and
    of the group) whose cache fits what the weights, gradients and Adam moments leave."""
    trl = load("e2e_trl")
    row = 2 * 28 * 8 * 128 * 2 * 2561  # K and V, layers, KV heads, head dim, bf16, tokens
    assert row == pytest.approx(293.7e6, rel=1e-3)
    assert trl.generation_batch(512, 8, 8, row, None) == 512  # no limit: TRL's default
    assert trl.generation_batch(512, 8, 8, row, 40e9) == 128  # 128 x 294 MB <= 40 GB < 256 x
    assert trl.generation_batch(512, 8, 8, row, 1e9) == 8  # never below one group
    assert trl.generation_batch(96, 8, 6, row, None) == 96
    assert trl.generation_batch(96, 8, 6, row, 20e9) == 48  # multiples of lcm(8, 6) = 24
    with pytest.raises(ValueError, match="micro-batch 8 and the group 6"):
        trl.generation_batch(40, 8, 6, row, None)


def test_kv_bytes_per_row_reads_the_models_config(tmp_path):
    trl = load("e2e_trl")
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 8, "num_key_value_heads": 4, "hidden_size": 2048,
         "num_attention_heads": 32}))  # no head_dim: hidden / heads = 64
    assert trl.kv_bytes_per_row(tmp_path, 100) == 2 * 8 * 4 * 64 * 2 * 100
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 8, "num_key_value_heads": 4, "head_dim": 128, "hidden_size": 2048,
         "num_attention_heads": 32}))
    assert trl.kv_bytes_per_row(tmp_path, 100) == 2 * 8 * 4 * 128 * 2 * 100
