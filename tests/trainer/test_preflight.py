"""The preflight against the device (PITFALLS T1): every phase's estimate against each GPU's free
memory, one line per phase that cannot fit, and ``megarl train`` refusing such a run (exit 2)
before any worker starts. The arithmetic is a pure function; the free memory is injected where
the GPU would be read (this machine has none)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl import memory_preflight
from megarl.config import load_config
from megarl.config.derived import derive_sizes
from megarl.config.estimates import estimate, phase_estimates
from megarl.config.model_info import load_model_info
from megarl.demo import DEMO_CONFIG
from megarl.memory_preflight import device_estimates, device_preflight, preflight

GB = 2**30
UPDATE_KNOBS = ("actor.ppo_micro_batch_size_per_gpu, actor.ppo_max_token_len_per_gpu, "
                "actor.recompute.granularity, actor.offload.optimizer_offload, "
                "actor.offload.grad_offload, actor.parallel.tp, actor.parallel.pp")


def test_each_phase_that_does_not_fit_the_least_free_gpu_gets_one_line():
    """The GPU with the least free memory decides; phases that fit it get no line."""
    estimates = {"gen": 60 * GB, "update_actor": int(227.6 * GB), "sync_weights": 101 * GB}
    free = {"GPU 0": int(139.5 * GB), "GPU 1": 100 * GB, "GPU 2": 140 * GB}
    update = ("preflight: phase 'update_actor' needs ~227.6 GB per GPU, GPU 1 has 100.0 GB "
              f"free — lower it with {UPDATE_KNOBS}")
    sync = ("preflight: phase 'sync_weights' needs ~101.0 GB per GPU, GPU 1 has 100.0 GB free "
            "— lower it with checkpoint_engine.bucket_size_mb, actor.offload.optimizer_offload, "
            "actor.offload.grad_offload, rollout.gpu_memory_utilization")
    assert preflight(estimates, free) == [update, sync]
    assert preflight(estimates, {"GPU 0": 228 * GB}) == []
    assert preflight({"update_actor": 100 * GB}, {"GPU 0": 100 * GB}) == []  # exactly fits
    assert preflight(estimates, {}) == []


@pytest.fixture(scope="module")
def cuda_run(demo_assets: Path) -> list[str]:
    """Overrides of the demo config: its tiny model and data, on GPUs."""
    return [f"model.path={demo_assets / 'model'}",
            f"data.train_files=[{demo_assets / 'data/train.parquet'}]",
            f"data.val_files=[{demo_assets / 'data/val.parquet'}]", "resources.device=cuda"]


def test_colocated_phases_count_what_the_other_role_holds(cuda_run):
    """Colocated: generation counts the actor's parameters (and what it does not offload) next
    to the engine, the sync the engine's weights; the update nothing of the engine's."""
    over = [*cuda_run, "rollout.colocate=true", "resources.rollout_pool=null",
            "resources.gpu_memory_gb=80"]
    kept, _ = load_config(str(DEMO_CONFIG), [*over, "actor.offload.grad_offload=false",
                                             "actor.offload.optimizer_offload=false"])
    offloaded, _ = load_config(str(DEMO_CONFIG), over)
    model = load_model_info(kept.model.path)
    with_state = device_estimates(kept, model, 80 * GB)
    light = device_estimates(offloaded, model, 80 * GB)
    est = estimate(offloaded, model, derive_sizes(offloaded, model))
    state = est.update.state
    # the engine takes gpu_memory_utilization of what is free when it loads (SGLang's sizing):
    # what the actor keeps counts whole, and shrinks the engine's share by that fraction of it
    fraction = offloaded.rollout.gpu_memory_utilization
    kept_more = state.grads + state.optimizer
    assert with_state["gen"] - light["gen"] == pytest.approx(kept_more * (1 - fraction), abs=2)
    # the optimizer state offloaded between phases is on the GPU for the optimizer step only:
    # the update's peak is the larger of its forwards and backwards and its step
    kept_update = estimate(kept, model, derive_sizes(kept, model)).update
    assert with_state["update_actor"] == kept_update.total == (
        kept_update.forward_backward) > light["update_actor"] == est.update.total
    assert est.update.total == max(est.update.forward_backward, est.update.optimizer_step)
    assert est.update.forward_backward == kept_update.forward_backward - state.optimizer
    assert light["sync_weights"] == (state.weights + est.buckets + est.engine.weights
                                     + est.update.other_roles)
    assert light["gen"] == est.engine.usable + state.weights + est.update.other_roles
    resident = state.weights + est.update.other_roles
    assert est.engine.usable == int((80 * GB - resident) * fraction)
    assert phase_estimates(est).keys() == {"gen", "old_log_prob", "update_actor", "sync_weights"}
    # the log-prob forward: the actor's weights (its grads and optimizer offloaded) and one
    # forward's activations and log-probs, next to the idle roles; the engine released
    lp = est.log_prob
    assert light["old_log_prob"] == (state.weights + lp.activations + lp.log_probs
                                     + est.update.other_roles)
    assert with_state["old_log_prob"] - light["old_log_prob"] == state.grads + state.optimizer
    assert 0 < lp.activations < est.update.activations


def test_a_run_that_cannot_fit_is_refused_before_any_worker_starts(cuda_run, tmp_path,
                                                                     monkeypatch, capsys):
    """``megarl train`` prints one line per phase and exits 2; nothing was started or written."""
    import ray

    from megarl.trainer import train_main

    monkeypatch.setattr(memory_preflight, "read_free_memory",
                        lambda: {"GPU 0": (80 * GB, 80 * GB), "GPU 1": (2**20, 80 * GB)})
    out = tmp_path / "run"
    assert train_main(["--config", str(DEMO_CONFIG), *cuda_run,
                       f"trainer.output_dir={out}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert [line.split(" needs ")[0] for line in err] == [
        "preflight: phase 'gen'", "preflight: phase 'old_log_prob'",
        "preflight: phase 'update_actor'", "preflight: phase 'sync_weights'"]
    assert all(", GPU 1 has 0.0 GB free — lower it with " in line for line in err)
    assert "actor.log_prob_max_token_len_per_gpu" in err[1]
    assert err[2].endswith(UPDATE_KNOBS)
    assert not out.exists() and not ray.is_initialized()


def test_the_switch_and_the_cases_without_a_check(cuda_run):
    """trainer.preflight=false and resources.device=cpu read nothing; a GPU run on a driver
    that sees no GPU says in one line that the check did not run; enough memory passes."""
    def never() -> dict:
        raise AssertionError("read the GPUs")

    cfg, _ = load_config(str(DEMO_CONFIG), [*cuda_run, "trainer.preflight=false"])
    model = load_model_info(cfg.model.path)
    assert device_preflight(cfg, model, read=never) == ([], False)
    cfg, _ = load_config(str(DEMO_CONFIG), [*cuda_run, "resources.device=cpu"])
    assert device_preflight(cfg, model, read=never) == ([], False)
    cfg, _ = load_config(str(DEMO_CONFIG), cuda_run)
    (line,), refused = device_preflight(cfg, model, read=dict)
    assert not refused and line.startswith("preflight: not run — this process sees no GPU")
    (line,), refused = device_preflight(cfg, model, read=lambda: {"GPU 0": (80 * GB, 80 * GB)})
    assert not refused and line.startswith("preflight: every phase fits (largest ~")
    assert line.endswith("least free: GPU 0, 80.0 GB, of 1 GPU(s))")


def test_the_visible_gpus_are_read_from_nvidia_smi():
    """CUDA_VISIBLE_DEVICES picks and orders the GPUs (indices or UUID prefixes); a device it
    cannot place (a MIG instance) leaves the reading to torch in a child process."""
    text = ("0, GPU-aaaa-1111, 140000, 143771\n"
            "1, GPU-bbbb-2222, 1024, 143771\n")
    mib = 2**20
    assert memory_preflight.parse_nvidia_smi(text, None) == {
        "GPU 0": (140000 * mib, 143771 * mib), "GPU 1": (1024 * mib, 143771 * mib)}
    assert memory_preflight.parse_nvidia_smi(text, "1") == {"GPU 0": (1024 * mib, 143771 * mib)}
    assert memory_preflight.parse_nvidia_smi(text, "GPU-bbbb,0") == {
        "GPU 0": (1024 * mib, 143771 * mib), "GPU 1": (140000 * mib, 143771 * mib)}
    assert memory_preflight.parse_nvidia_smi(text, "MIG-cccc") is None
    assert memory_preflight.parse_nvidia_smi("0, x, [N/A], 1\n", None) is None
