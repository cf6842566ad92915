"""``mcore-to-hf`` reads megarl's training checkpoints (model + distributed-optimizer state +
RNG states, under a root with a ``latest`` pointer): the exported HF tensors are bit for bit the
weights the trained engine itself exports through mbridge."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from bridge_cases import assert_same_tensors, read_tensors

from bridge.checks import ConversionError, Layout
from bridge.mcore_to_hf import mcore_to_hf


def train_and_save(model_dir: str, layout: Layout, root: str) -> dict[str, torch.Tensor]:
    """Run on each rank: one Adam step on random data, save a training checkpoint at step 3,
    return the engine's own HF-named export of the trained weights."""
    from megarl.megatron.checkpoint import save_checkpoint
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.optimizer import OptimizerSettings, TrainableActor
    from megarl.megatron.update import LossSettings, TrainSequence, train_step

    model = build_actor_model(model_dir, layout.sizes(), torch.float32, spec="native")
    actor = TrainableActor(model, OptimizerSettings(lr=1e-2, use_distributed_optimizer=True))
    g = torch.Generator().manual_seed(0)
    batch = [TrainSequence(tokens=torch.randint(0, 128, (n,), generator=g),
                           loss_mask=torch.ones(n), old_log_probs=-5 * torch.ones(n),
                           advantages=torch.randn(n, generator=g)) for n in (9, 12)]
    train_step(actor, batch, LossSettings())
    save_checkpoint(root, actor, 3)
    return {n: t.detach().clone() for n, t in model.bridge.export_weights(model.chunks)}


@pytest.fixture(scope="module")
def training_root(tiny_models, _ranks_cache, tmp_path_factory):
    """A training checkpoint root of qwen3_moe saved under EP=2, and the trained weights."""
    root = tmp_path_factory.mktemp("training") / "ckpt"
    trained = _ranks_cache.get().run(train_and_save, tiny_models["qwen3_moe"], Layout(ep=2),
                                     str(root))[0]
    return root, trained


def test_export_of_a_training_checkpoint(tiny_models, training_root, tmp_path):
    root, trained = training_root
    assert (root / "latest").read_text().strip() == "step_00000003"
    summary = mcore_to_hf(root, tmp_path / "hf", hf_config=tiny_models["qwen3_moe"])
    assert summary["checkpoint"] == str(root / "step_00000003")
    exported = read_tensors(tmp_path / "hf")
    assert_same_tensors(trained, exported)
    source = read_tensors(tiny_models["qwen3_moe"])
    assert not torch.equal(exported["model.layers.0.self_attn.q_proj.weight"],
                           source["model.layers.0.self_attn.q_proj.weight"])  # it was trained


def test_config_of_another_model_is_refused(tiny_models, training_root, tmp_path):
    root, _ = training_root
    other = tmp_path / "other"
    shutil.copytree(tiny_models["qwen3_moe"], other)
    config = json.loads((other / "config.json").read_text())
    config["moe_intermediate_size"] = 16
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="moe_intermediate_size: checkpoint 32, config 16"):
        mcore_to_hf(root, tmp_path / "hf", hf_config=other)
    assert not (tmp_path / "hf").exists()
