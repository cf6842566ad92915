"""``megarl demo``: the README's main job on any machine, with nothing downloaded.

Builds a tiny random Qwen3-MoE model (with a locally made tokenizer) and a synthetic verifiable
task under ``outputs/tiny-moe/``, then runs ``megarl train --config configs/tiny-moe-cpu.yaml``:
Megatron actor workers (expert parallel 2) and an embedded rollout engine in separate Ray pools,
GRPO, weights streamed to the engine after every step. Prints where the metrics and plot are.
"""

from __future__ import annotations

import argparse
from pathlib import Path

DEMO_ROOT = Path("outputs/tiny-moe")
DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny-moe-cpu.yaml"
TASK = "copy_digit"


def prepare_demo_assets(root: Path = DEMO_ROOT, seed: int = 0) -> tuple[Path, Path, Path]:
    """Write the tiny model and the train/val data (once); returns their paths."""
    from megarl.data.synthetic import write_synthetic_dataset
    from megarl.data.tiny_model import make_tiny_model

    model, train, val = root / "model", root / "data" / "train.parquet", root / "data" / "val.parquet"
    if not (model / "config.json").exists():
        make_tiny_model(model, arch="qwen3_moe", seed=seed)
    if not train.exists():
        write_synthetic_dataset(train, TASK, 2048, seed=seed, split="train")
    if not val.exists():
        write_synthetic_dataset(val, TASK, 64, seed=seed + 1, split="val")
    return model, train, val


def demo_main(argv: list[str]) -> int:
    """Prepare the demo's model and data, then train on them."""
    parser = argparse.ArgumentParser(prog="megarl demo", description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*", metavar="a.b.c=value",
                        help="overrides of configs/tiny-moe-cpu.yaml (e.g. trainer.total_steps=5)")
    args = parser.parse_args(argv)
    prepare_demo_assets()
    from megarl.trainer import train_main

    return train_main(["--config", str(DEMO_CONFIG), *args.overrides])
