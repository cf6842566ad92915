"""``megarl demo``: the README's main job on any machine, with nothing downloaded.

On CPU (the default) it builds a tiny random Qwen3-MoE model (with a locally made tokenizer) and a
synthetic verifiable task under ``outputs/tiny-moe/``, then runs ``megarl train --config
configs/tiny-moe-cpu.yaml``: Megatron actor workers (expert parallel 2) and an embedded rollout
engine in separate Ray pools, GRPO, weights streamed to the engine after every step.

``megarl demo --device cuda`` runs the one-GPU version: a ~0.3B-parameter random Qwen3-MoE
(8 layers, 16 experts, top-2) learning the harder ``copy_number`` task under ``outputs/moe-gpu/``
with ``configs/moe-gpu-demo.yaml``: the actor and the embedded engine share the GPU (colocated),
the engine releases its memory while the actor trains, and weights move over CUDA IPC.
``megarl demo --device cuda --lora`` runs LoRA where a full fine-tune cannot fit: a random
10B-parameter Qwen3-MoE with Qwen3-30B-A3B's layers (16 of its 48) trains on ``copy_number``
through rank-32 adapters on the attention with ``configs/moe-lora-gpu-demo.yaml`` under
``outputs/moe-lora-gpu/``; its model is drawn on the GPU in bf16.
``megarl demo --tools`` runs the multi-turn tools demo on CPU: the CPU demo's tiny model, first
warm-started on tool-call demonstrations (:mod:`megarl.data.warm_start`, a stand-in for an
instruct model), learns to call a calculator for ``tool_multiply`` with
``configs/tiny-moe-tools.yaml``. ``megarl demo --lora`` runs the CPU demo with LoRA: rank-16
adapters on every linear layer of a tiny random dense Qwen3 (the base frozen) learn ``copy_digit``
with ``configs/tiny-dense-lora-cpu.yaml`` under ``outputs/tiny-dense-lora/``; its model is drawn
with ``initializer_range`` 0.1, since the frozen output layer bounds what the adapters can do.

Prints where the metrics and plot are.
"""

from __future__ import annotations

import argparse
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@dataclass(frozen=True)
class DemoSpec:
    """What one demo builds and runs."""

    root: Path
    config: Path
    task: str
    model: dict[str, Any] = field(default_factory=dict)
    """Overrides of the tiny model's config (``make_tiny_model``)."""
    arch: str = "qwen3_moe"
    """The tiny model's architecture (``make_tiny_model``)."""
    dtype: str = "float32"
    """The model's weights and ``torch_dtype``."""
    build_device: str = "cpu"
    """Where the model's random weights are drawn (``make_tiny_model``'s ``device``)."""
    train_rows: int = 2048
    warm_start_steps: int = 0
    """Supervised steps on tool-call demonstrations before RL (:mod:`megarl.data.warm_start`);
    0 = start RL from the random model."""


DEMOS = {
    "cpu": DemoSpec(Path("outputs/tiny-moe"), CONFIGS / "tiny-moe-cpu.yaml", "copy_digit"),
    "cuda": DemoSpec(Path("outputs/moe-gpu"), CONFIGS / "moe-gpu-demo.yaml", "copy_number", {
        "hidden_size": 768, "num_hidden_layers": 8, "num_attention_heads": 12,
        "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 2048, "num_experts": 16,
        "num_experts_per_tok": 2, "moe_intermediate_size": 1024}, train_rows=8192),
    "tools": DemoSpec(Path("outputs/tiny-moe-tools"), CONFIGS / "tiny-moe-tools.yaml",
                      "tool_multiply", warm_start_steps=400),
    # LoRA freezes the output layer and the final norm, so a token's logit is at most
    # |lm_head row| x sqrt(hidden_size): at HF's initializer_range 0.02 no hidden state gives a
    # digit more than ~3% probability, at 0.1 up to ~75% (the random model's output stays near
    # uniform: entropy 4.5 of ln 128 = 4.85), at 0.2 the random model is already peaked
    "lora": DemoSpec(Path("outputs/tiny-dense-lora"), CONFIGS / "tiny-dense-lora-cpu.yaml",
                     "copy_digit", {"initializer_range": 0.1}, arch="qwen3"),
    # Qwen3-30B-A3B's layers (hidden 2048, 32 query / 4 KV heads, 128 experts, top-8) at 16 of
    # its 48 layers: 10.0B parameters, 18.6 GB in bf16. Its full fine-tune's step needs ~96 GiB
    # (fp32 grads and main weights, Adam's moments streamed), more than one H100; rank-32 adapters
    # on the attention need ~0.1 GB more than the frozen base. Drawn on the GPU in bf16 (fp32 on the host: 40 GB)
    "cuda-lora": DemoSpec(Path("outputs/moe-lora-gpu"), CONFIGS / "moe-lora-gpu-demo.yaml",
                          "copy_number", {
        "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "max_position_embeddings": 4096}, dtype="bfloat16", build_device="cuda",
        train_rows=8192),
}
# the warm start's demonstrations: this fraction calls the calculator, the rest guess
WARM_START_CALL_FRACTION = 0.3
DEMO_ROOT = DEMOS["cpu"].root
DEMO_CONFIG = DEMOS["cpu"].config
TASK = DEMOS["cpu"].task


def prepare_demo_assets(root: Path = DEMO_ROOT, seed: int = 0,
                        spec: DemoSpec = DEMOS["cpu"]) -> tuple[Path, Path, Path]:
    """Write the demo's model and train/val data (once); returns their paths."""
    import torch

    from megarl.data.synthetic import write_synthetic_dataset
    from megarl.data.tiny_model import make_tiny_model

    model, train, val = root / "model", root / "data" / "train.parquet", root / "data" / "val.parquet"
    if not train.exists():
        write_synthetic_dataset(train, spec.task, spec.train_rows, seed=seed, split="train")
    if not (model / "config.json").exists():
        building = model.with_name(model.name + ".building")  # never a half-made model
        shutil.rmtree(building, ignore_errors=True)
        make_tiny_model(building, arch=spec.arch, seed=seed, dtype=getattr(torch, spec.dtype),
                        device=spec.build_device, **spec.model)
        if spec.warm_start_steps:
            warm_start(building, spec.task, spec.warm_start_steps, seed)
        building.rename(model)
    if not val.exists():
        write_synthetic_dataset(val, spec.task, 64, seed=seed + 1, split="val")
    return model, train, val


def warm_start(model: Path, task: str, steps: int, seed: int) -> None:
    """Supervised warm start of ``model`` on tool-call demonstrations of ``task`` (prompts of
    their own, none of the RL data's)."""
    from transformers import AutoTokenizer

    from megarl.data.synthetic import generate_rows
    from megarl.data.warm_start import demonstrations, sft

    rows = generate_rows(task, 2048, seed=seed + 1000, split="warm_start")
    examples = demonstrations(rows, AutoTokenizer.from_pretrained(model),
                              WARM_START_CALL_FRACTION, seed=seed)
    print(f"[demo] warm start: {steps} supervised steps on {len(examples)} demonstrations "
          f"({WARM_START_CALL_FRACTION:.0%} call the calculator)", flush=True)
    sft(model, examples, steps=steps, seed=seed)


def parse_demo(argv: list[str]) -> tuple[DemoSpec, list[str]]:
    """The demo that ``megarl demo``'s arguments choose, and the config overrides they carry."""
    parser = argparse.ArgumentParser(prog="megarl demo", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: the tiny CPU demo; cuda: the one-GPU colocated demo")
    parser.add_argument("--tools", action="store_true",
                        help="the multi-turn tools demo on CPU (configs/tiny-moe-tools.yaml)")
    parser.add_argument("--lora", action="store_true",
                        help="LoRA: on CPU, adapters on a tiny dense model "
                             "(configs/tiny-dense-lora-cpu.yaml); with --device cuda, on a "
                             "10B MoE whose full fine-tune does not fit one H100 "
                             "(configs/moe-lora-gpu-demo.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="a.b.c=value",
                        help="overrides of the demo's config (e.g. trainer.total_steps=5)")
    args = parser.parse_args(argv)
    if args.tools and args.device != "cpu":
        parser.error("--tools: this demo runs on CPU only (leave out --device)")
    if args.tools and args.lora:
        parser.error("--tools and --lora: choose one demo")
    if args.tools:
        return DEMOS["tools"], args.overrides
    if args.lora:
        return DEMOS["lora" if args.device == "cpu" else "cuda-lora"], args.overrides
    return DEMOS[args.device], args.overrides


def demo_main(argv: list[str]) -> int:
    """Prepare the demo's model and data, then train on them."""
    spec, overrides = parse_demo(argv)
    prepare_demo_assets(spec.root, spec=spec)
    from megarl.trainer import train_main

    return train_main(["--config", str(spec.config), *overrides])
