"""mbridge's Qwen2 bridge rewrites its class's name mapping for tied embeddings; megarl's
``make_bridge`` keeps that on the one bridge, so later untied Qwen2/Qwen3 models of the same
process still map the output layer to ``lm_head.weight``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def test_tied_bridge_does_not_tie_later_bridges(tiny_models, tmp_path):
    from mbridge.core.parallel_states import ParallelStates

    from megarl.megatron.model import load_hf_config, make_bridge

    tied = tmp_path / "tied"
    shutil.copytree(tiny_models["qwen2"], tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))

    def output_layer_source(model_dir: str | Path) -> list[str]:
        bridge = make_bridge(load_hf_config(model_dir), parallel_states=ParallelStates())
        return bridge._weight_name_mapping_mcore_to_hf("output_layer.weight")

    assert output_layer_source(tied) == ["model.embed_tokens.weight"]
    for name in ("qwen2", "qwen3"):
        assert output_layer_source(tiny_models[name]) == ["lm_head.weight"], name
