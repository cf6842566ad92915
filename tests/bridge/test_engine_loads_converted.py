"""The megarl engine loads a ``megarl-convert hf-to-mcore`` checkpoint under another layout
(``megarl.megatron.checkpoint.load_model_weights``, used by ``model.mcore_checkpoint``): its
log-probs equal those of the same model loaded from the HF safetensors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from bridge.checks import Layout


def log_probs_from(model_dir: str, layout: Layout, source: str) -> list[list[float]]:
    """Run on each rank: build the engine's model under ``layout`` with weights from ``source``
    ("hf": the safetensors, "random": none, else a checkpoint loaded over a random init);
    log-probs of two fixed sequences."""
    from megarl.megatron.checkpoint import load_model_weights
    from megarl.megatron.logprobs import compute_log_probs
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.parallel import destroy_parallel

    destroy_parallel()
    model = build_actor_model(model_dir, layout.sizes(), torch.float32, spec="native",
                              load_weights=source == "hf", seed=7)
    if source not in ("hf", "random"):
        load_model_weights(source, model)
    g = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, 128, (n,), generator=g) for n in (11, 17)]
    with torch.no_grad():
        out = compute_log_probs(model, sequences)
    return [lp.float().tolist() for lp in out.log_probs]


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(float((torch.tensor(x) - torch.tensor(y)).abs().max()) for x, y in zip(a, b))


def test_converted_checkpoint_loads_under_another_layout(tiny_models, converted, ranks):
    """qwen3_moe converted under EP=2, loaded under TP=2 (and the reference from HF under TP=2)."""
    name = "qwen3_moe"
    reference = ranks.run(log_probs_from, tiny_models[name], Layout(tp=2), "hf")[0]
    loaded = ranks.run(log_probs_from, tiny_models[name], Layout(tp=2), converted[name])[0]
    random_init = ranks.run(log_probs_from, tiny_models[name], Layout(tp=2), "random")[0]
    assert _max_diff(reference, random_init) > 1e-2  # loading is what makes them equal
    assert _max_diff(reference, loaded) < 1e-5


def test_dense_checkpoint_loads_under_pipeline_layout(tiny_models, converted, ranks):
    """qwen3 converted under TP=2, loaded under PP=2."""
    name = "qwen3"
    reference = ranks.run(log_probs_from, tiny_models[name], Layout(pp=2), "hf")[0]
    loaded = ranks.run(log_probs_from, tiny_models[name], Layout(pp=2), converted[name])[0]
    assert _max_diff(reference, loaded) < 1e-5


def test_checkpoint_of_another_model_is_refused(tiny_models, converted, tmp_path):
    """A converted checkpoint whose HF config disagrees with the model is refused by name."""
    from megarl.megatron.checkpoint import _converted_model_fingerprint, check_same_model
    from megarl.megatron.model import load_hf_config

    other = tmp_path / "other"
    shutil.copytree(converted["qwen3_moe"], other)
    config = json.loads((other / "hf" / "config.json").read_text())
    config["moe_intermediate_size"] = 16
    (other / "hf" / "config.json").write_text(json.dumps(config))
    saved = _converted_model_fingerprint(other)
    assert saved["moe_intermediate_size"] == 16
    with pytest.raises(ValueError, match="moe_intermediate_size: checkpoint 16, model 32"):
        check_same_model(saved, load_hf_config(tiny_models["qwen3_moe"]), other)
