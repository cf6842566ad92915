"""Every flag megarl's launcher emits is one real SGLang's own parser knows, with the meaning
megarl intends (``sglang/srt/server_args.py``: ``ServerArgs.add_cli_args``, ``from_cli_args``)."""

from __future__ import annotations

import argparse
import dataclasses
import types
from typing import Any

import pytest

from megarl.rollout.sglang.launcher import SGLangLaunchConfig, build_sglang_command

# Each config turns options on; together they cover every field of SGLangLaunchConfig.
CONFIGS = {
    "defaults": SGLangLaunchConfig(model_path="/ckpt/m"),
    "everything": SGLangLaunchConfig(
        model_path="/ckpt/Qwen3-30B-A3B", host="10.0.0.5", port=30010, tp_size=4, dp_size=2,
        ep_size=4, pp_size=2, enable_dp_attention=True, mem_fraction_static=0.75,
        enable_memory_saver=True, enable_weights_cpu_backup=True, skip_tokenizer_init=True,
        enable_return_routed_experts=True,
        load_format="dummy", weight_version="7", enable_deterministic_inference=True,
        skip_server_warmup=True, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000",
        base_gpu_id=4, nccl_port=31000, enable_metrics=True, dtype="bfloat16",
        quantization="fp8", context_length=4096, max_running_requests=128, random_seed=1234,
        trust_remote_code=True, log_level="warning", enable_lora=True, max_lora_rank=16,
        lora_target_modules=("q_proj", "v_proj", "down_proj"), max_prefill_tokens=8192,
        chunked_prefill_size=4096, extra_args=("--cuda-graph-max-bs", "256")),
    "tokenizer_and_no_mem_fraction": SGLangLaunchConfig(
        model_path="/ckpt/m", skip_tokenizer_init=False, mem_fraction_static=None,
        load_format="auto", dtype="auto"),
}

def _fields(**values: Any) -> dict[str, Any]:
    return values


# What each config means, in ServerArgs field names (after from_cli_args' renaming).
EXPECTED: dict[str, dict[str, Any]] = {
    "defaults": _fields(model_path="/ckpt/m", host="127.0.0.1", port=30000, tp_size=1,
                     mem_fraction_static=0.7, skip_tokenizer_init=True),
    "everything": _fields(
        model_path="/ckpt/Qwen3-30B-A3B", host="10.0.0.5", port=30010, tp_size=4, dp_size=2,
        ep_size=4, pp_size=2, enable_dp_attention=True, mem_fraction_static=0.75,
        enable_memory_saver=True, enable_weights_cpu_backup=True, skip_tokenizer_init=True,
        enable_return_routed_experts=True,
        load_format="dummy", weight_version="7", enable_deterministic_inference=True,
        skip_server_warmup=True, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000",
        base_gpu_id=4, nccl_port=31000, enable_metrics=True, dtype="bfloat16",
        quantization="fp8", context_length=4096, max_running_requests=128, random_seed=1234,
        trust_remote_code=True, log_level="warning", enable_lora=True, max_lora_rank=16,
        lora_target_modules=["q_proj", "v_proj", "down_proj"], max_prefill_tokens=8192,
        chunked_prefill_size=4096, cuda_graph_max_bs=256),
    "tokenizer_and_no_mem_fraction": _fields(
        skip_tokenizer_init=False, mem_fraction_static=None, load_format="auto", dtype="auto"),
}


def test_the_table_turns_every_option_on() -> None:
    fields = {f.name for f in dataclasses.fields(SGLangLaunchConfig)}
    defaults = SGLangLaunchConfig(model_path="/ckpt/m")
    changed = {name for cfg in CONFIGS.values() for name in fields
               if getattr(cfg, name) != getattr(defaults, name)}
    assert fields - changed <= {"model_path"}, f"no row sets {sorted(fields - changed - {'model_path'})}"


def _parse(server_args: types.ModuleType, argv: list[str]) -> Any:
    """argv -> the ServerArgs SGLang would build (its __post_init__, which probes GPUs, skipped)."""
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    try:
        namespace = parser.parse_args(argv)
    except SystemExit as err:
        raise AssertionError(f"SGLang's parser refuses {argv} (see stderr)") from err

    class Unchecked(server_args.ServerArgs):  # same fields and from_cli_args, no GPU checks
        def __post_init__(self) -> None:
            pass

    return Unchecked.from_cli_args(namespace)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sglang_parses_the_launch_command(name: str, sglang_server_args: types.ModuleType
                                          ) -> None:
    argv = build_sglang_command(CONFIGS[name], python="python")
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    args = _parse(sglang_server_args, argv[3:])
    got = {field: getattr(args, field) for field in EXPECTED[name]}
    assert got == EXPECTED[name]


def test_the_reference_parser_refuses_unknown_flags(sglang_server_args: types.ModuleType) -> None:
    """The check above is not vacuous: a flag SGLang lacks fails it."""
    with pytest.raises(AssertionError, match="refuses"):
        _parse(sglang_server_args, ["--model-path", "/m", "--return-routed-experts"])
