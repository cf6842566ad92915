"""Actor checkpoints on real gloo ranks: reload under another layout, optimizer/schedule/RNG
round trip, atomic publication, rotation, and rejection of another model's checkpoint.

Models that load a checkpoint are built without the HF weights (megatron's random init), so
equal log-probs can only come from the checkpoint; they are also checked to differ before the
load.
"""

from __future__ import annotations

import contextlib
import multiprocessing

import pytest
import torch

from megarl.megatron.parallel import ParallelSizes

LENGTHS = (9, 14, 6, 11)
BUDGET = 16


def sequences() -> list[torch.Tensor]:
    """The token sequences every test scores and trains on."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 128, (n,), generator=g) for n in LENGTHS]


@contextlib.contextmanager
def child_processes_allowed():
    """megatron's checkpoint writer starts helper processes, which Python forbids to daemonic
    processes such as RankPool's ranks (Ray workers and torchrun ranks are not daemonic)."""
    config = multiprocessing.current_process()._config
    before = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = before


def build(
    model_dir: str,
    sizes: ParallelSizes,
    load_weights: bool = True,
    adam: bool = True,
    distributed: bool = True,
):
    """The model, wrapped as a TrainableActor (Adam, LR warm-up; the distributed optimizer if
    ``distributed``) if ``adam``."""
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.optimizer import OptimizerSettings, TrainableActor

    model = build_actor_model(
        model_dir, sizes, torch.float32, spec="native", load_weights=load_weights
    )
    if not adam:
        return model
    settings = OptimizerSettings(
        lr=1e-2,
        weight_decay=0.01,
        lr_warmup_steps=4,
        total_steps=10,
        use_distributed_optimizer=distributed,
    )
    return TrainableActor(model, settings)


def log_probs(model) -> list[torch.Tensor]:
    """Log-probs of the test sequences."""
    from megarl.megatron.logprobs import compute_log_probs

    return compute_log_probs(model, sequences(), max_tokens_per_micro_batch=BUDGET).log_probs


def train(actor, seed: int) -> dict[str, float]:
    """One PPO step on the test sequences (advantages and old log-probs drawn from ``seed``)."""
    from megarl.megatron.update import LossSettings, TrainSequence, train_step

    g = torch.Generator().manual_seed(seed)
    batch = [
        TrainSequence(
            tokens=s,
            loss_mask=(torch.arange(len(s)) >= 2).float(),
            old_log_probs=lp + 0.05 * torch.randn(len(s), generator=g),
            advantages=torch.randn(len(s), generator=g),
        )
        for s, lp in zip(sequences(), log_probs(actor.model))
    ]
    return train_step(actor, batch, LossSettings(), max_tokens_per_micro_batch=BUDGET)


def weights(model) -> dict[str, torch.Tensor]:
    """All weights under their HF names (every rank takes part; all get them)."""
    return {n: t.detach().clone() for n, t in model.bridge.export_weights(model.chunks)}


def train_and_save(model_dir, sizes, root):
    """Run on each rank: one update step, save, one more step; returns the log-probs at save
    time and the weights after the next step."""
    from megarl.megatron.checkpoint import save_checkpoint

    actor = build(model_dir, sizes)
    train(actor, seed=0)
    with child_processes_allowed():
        save_checkpoint(root, actor, 1)
    saved = log_probs(actor.model)
    train(actor, seed=1)
    return saved, weights(actor.model)


def load_and_score(model_dir, sizes, root):
    """Run on each rank: log-probs of a randomly initialised actor before and after loading,
    and its weights after one more step."""
    from megarl.megatron.checkpoint import load_checkpoint

    actor = build(model_dir, sizes, load_weights=False)
    before = log_probs(actor.model)
    loaded = load_checkpoint(root, actor)
    after = log_probs(actor.model)
    train(actor, seed=1)
    return before, after, loaded, weights(actor.model)


def assert_reloaded(saved, before, after, atol=1e-5) -> None:
    """``after`` equals ``saved``; ``before`` (random init) did not."""
    assert max((b - s).abs().max().item() for b, s in zip(before, saved)) > 0.1
    for a, s in zip(after, saved):
        torch.testing.assert_close(a, s, atol=atol, rtol=0)


@pytest.mark.parametrize(
    "save_sizes,load_sizes",
    [(ParallelSizes(tp=2), ParallelSizes(pp=2)), (ParallelSizes(ep=2), ParallelSizes())],
    ids=["tp2-to-pp2", "ep2-to-1"],
)
def test_reload_under_another_layout(pool1, pool2, tiny_models, tmp_path, save_sizes, load_sizes):
    """Qwen3-MoE (experts sharded by TP, then by EP): saved, reloaded under another layout;
    the resharded Adam state gives the same next step as on the saving layout."""
    path = tiny_models["qwen3_moe"]
    saved, continued = pool2.run(train_and_save, path, save_sizes, tmp_path)[0]
    load_pool = pool2 if load_sizes.model_parallel * load_sizes.ep > 1 else pool1
    for before, after, loaded, resumed in load_pool.run(load_and_score, path, load_sizes, tmp_path):
        assert_reloaded(saved, before, after)
        assert loaded.step == 1 and loaded.optimizer_restored and not loaded.rng_restored
        for name, value in continued.items():
            torch.testing.assert_close(resumed[name], value, atol=1e-6, rtol=0, msg=name)


def resume_on_rank(model_dir, sizes, root, resume: bool, distributed: bool):
    """Run on each rank: step 1, save, step 2 (``resume=False``); or load, step 2 (``resume``).
    Returns the weights after step 2, its metrics, a few RNG draws and the loaded record."""
    from megarl.megatron.checkpoint import load_checkpoint, save_checkpoint

    actor = build(model_dir, sizes, load_weights=not resume, distributed=distributed)
    loaded = None
    if resume:
        loaded = load_checkpoint(root, actor)
    else:
        train(actor, seed=0)
        with child_processes_allowed():
            save_checkpoint(root, actor, 1, extra={"loader": {"epoch": 0, "index": 8}})
    draws = torch.rand(4)
    metrics = train(actor, seed=1)
    return weights(actor.model), metrics, draws, loaded


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed", "replicated"])
def test_optimizer_round_trip(pool2, tiny_models, tmp_path, distributed):
    """EP=2 x DP=2 Adam (sharded or not) with LR warm-up: one more step after a reload equals
    one more step without it (Adam moments and step count, LR schedule, RNG)."""
    path, sizes = tiny_models["qwen3_moe"], ParallelSizes(ep=2)
    continued = pool2.run(resume_on_rank, path, sizes, tmp_path, False, distributed)
    resumed = pool2.run(resume_on_rank, path, sizes, tmp_path, True, distributed)
    for (w_a, m_a, r_a, _), (w_b, m_b, r_b, loaded) in zip(continued, resumed):
        assert loaded.step == 1 and loaded.extra == {"loader": {"epoch": 0, "index": 8}}
        assert loaded.optimizer_restored and loaded.rng_restored
        assert torch.equal(r_a, r_b), "RNG state not restored"
        # linear warm-up over 4 steps: the second step (index 1) runs at lr * 1/4
        assert m_a["actor/lr"] == m_b["actor/lr"] == pytest.approx(1e-2 / 4)
        for name in w_a:
            assert torch.equal(w_b[name], w_a[name]), name


def crash_on_rank(model_dir, root):
    """Run on one rank: save step 1, fail the publication of step 2, reload, then save steps 3
    and 4 with keep_last=2. Returns what the test checks."""
    from megarl.megatron import checkpoint

    model = build(model_dir, ParallelSizes(), adam=False)
    with child_processes_allowed():
        checkpoint.save_checkpoint(root, model, 1)
        at_step_1 = log_probs(model)
        with torch.no_grad():
            for p in model.chunks[0].parameters():
                p.add_(0.05)
        publish = checkpoint._publish

        def crash(tmp, final):
            raise OSError("simulated crash after the shards were written")

        checkpoint._publish = crash
        try:
            checkpoint.save_checkpoint(root, model, 2)
        except OSError:
            pass
        finally:
            checkpoint._publish = publish
        after_crash = sorted(p.name for p in root.iterdir())
        latest = checkpoint.latest_checkpoint(root).name
        loaded = checkpoint.load_checkpoint(root, model)
        reloaded = log_probs(model)
        for step in (3, 4):
            checkpoint.save_checkpoint(root, model, step, keep_last=2)
    return at_step_1, after_crash, latest, loaded.step, reloaded, sorted(root.iterdir())


def test_crash_mid_save_keeps_previous(pool1, tiny_models, tmp_path):
    at_step_1, after_crash, latest, loaded_step, reloaded, final = pool1.run(
        crash_on_rank, tiny_models["qwen3"], tmp_path
    )[0]
    assert latest == "step_00000001" and loaded_step == 1
    assert "step_00000002" not in after_crash
    assert any(name.startswith("step_00000002.tmp-") for name in after_crash)
    for a, b in zip(reloaded, at_step_1):
        assert torch.equal(a, b)
    assert [p.name for p in final] == ["latest", "step_00000003", "step_00000004"]
    assert (tmp_path / "latest").read_text() == "step_00000004"


def load_other_model(saved_dir, other_dir, root):
    """Run on one rank: save a checkpoint of one model, load it into another."""
    from megarl.megatron.checkpoint import load_checkpoint, save_checkpoint
    from megarl.megatron.parallel import destroy_parallel

    with child_processes_allowed():
        save_checkpoint(root, build(saved_dir, ParallelSizes(), adam=False), 1)
    destroy_parallel()
    other = build(other_dir, ParallelSizes(), adam=False)
    try:
        load_checkpoint(root, other)
    except ValueError as e:
        return str(e)
    return "no error"


def test_other_model_is_rejected(pool1, tiny_models, tmp_path):
    message = pool1.run(
        load_other_model, tiny_models["qwen3"], tiny_models["qwen3_4layers"], tmp_path
    )[0]
    assert "different model" in message
    assert "num_hidden_layers: checkpoint 2, model 4" in message


# the writers wait this long before writing: a save that blocked the step could not return
# sooner (staging alone took 0.5-1.5 s on a loaded 2-core machine)
WRITE_DELAY_S = 6.0


def background_resume_on_rank(model_dir, sizes, root, delay_s: float):
    """Run on each rank: step 1, a background save of it whose writers are held back
    ``delay_s`` (a slow file system), step 2 while it is written (changing the weights and
    Adam state in place), then publish. Returns what resume_on_rank returns, and what the test
    checks about the timing and ``latest`` meanwhile."""
    import os
    import time

    from megarl.faults import WRITE_DELAY_ENV
    from megarl.megatron.checkpoint import BackgroundSaves, latest_checkpoint, start_save

    actor = build(model_dir, sizes)
    train(actor, seed=0)
    saves = BackgroundSaves()
    os.environ[WRITE_DELAY_ENV] = str(delay_s)
    with child_processes_allowed():
        try:
            start = time.monotonic()
            saves.submit(start_save(root, actor, 1,
                                    extra={"loader": {"epoch": 0, "index": 8}}))
            blocked_s = time.monotonic() - start
        finally:
            del os.environ[WRITE_DELAY_ENV]
        draws = torch.rand(4)
        metrics = train(actor, seed=1)
        during = latest_checkpoint(root)
        published = saves.finish()
    total_s = time.monotonic() - start
    timing = {"blocked_s": blocked_s, "total_s": total_s, "latest_during": during,
              "published": published, "latest_after": latest_checkpoint(root)}
    return weights(actor.model), metrics, draws, timing


def test_background_save_is_the_state_at_save_time(pool2, tiny_models, tmp_path):
    """EP=2 x DP=2 with the distributed Adam: a background save returns before its (held back)
    write, training goes on and changes the weights meanwhile, and the published checkpoint
    holds the state at save time: resuming from it gives exactly the step the saving run took
    next (weights, metrics, RNG draws)."""
    path, sizes = tiny_models["qwen3_moe"], ParallelSizes(ep=2)
    continued = pool2.run(background_resume_on_rank, path, sizes, tmp_path, WRITE_DELAY_S)
    resumed = pool2.run(resume_on_rank, path, sizes, tmp_path, True, True)
    for (w_a, m_a, r_a, timing), (w_b, m_b, r_b, loaded) in zip(continued, resumed):
        print(f"\nbackground save: step blocked {timing['blocked_s']:.2f} s; written and "
              f"published after {timing['total_s']:.2f} s (writers held back {WRITE_DELAY_S} s)")
        # returned before its writers could have written, and published only after they did
        assert timing["blocked_s"] < WRITE_DELAY_S <= timing["total_s"]
        assert timing["latest_during"] is None  # nothing published while it was written
        assert timing["published"] == timing["latest_after"] == tmp_path / "step_00000001"
        assert loaded.step == 1 and loaded.extra == {"loader": {"epoch": 0, "index": 8}}
        assert loaded.optimizer_restored and loaded.rng_restored
        assert torch.equal(r_a, r_b), "RNG state not restored"
        assert m_a == m_b
        for name in w_a:
            assert torch.equal(w_b[name], w_a[name]), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]


def killed_during_background_write(model_dir, root, port, ready):
    """A process of its own (one gloo rank): save step 1, start a background save of step 2
    whose writer waits two minutes, write the writer's pid to ``ready``, wait to be killed."""
    import os
    import time

    import psutil
    import torch.distributed as dist

    from megarl.faults import WRITE_DELAY_ENV
    from megarl.megatron import checkpoint

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = build(model_dir, ParallelSizes(), adam=False)
    checkpoint.save_checkpoint(root, model, 1)
    helpers = {p.pid for p in psutil.Process().children()}  # megatron's results queue manager
    os.environ[WRITE_DELAY_ENV] = "120"
    saves = checkpoint.BackgroundSaves()
    saves.submit(checkpoint.start_save(root, model, 2))
    writers = [p.pid for p in psutil.Process().children() if p.pid not in helpers]
    ready.write_text(" ".join(map(str, writers)) + "\n" + " ".join(map(str, helpers)))
    time.sleep(300)


@pytest.mark.slow  # a fresh process imports megatron-core: ~2 min on 2 loaded cores
def test_kill_during_background_write(pool1, tiny_models, tmp_path):
    """SIGKILL a rank while its background writer is held back: ``latest`` still names the
    previous checkpoint, the writer dies with the rank, and the next save clears the leftover
    temporary directory. (The trainer-level crash mid-save is in tests/trainer/test_resume.py.)
    """
    import os
    import signal
    import time

    import psutil
    from dist_utils import free_port

    root, ready = tmp_path / "ckpt", tmp_path / "ready"
    proc = multiprocessing.get_context("spawn").Process(
        target=killed_during_background_write,
        args=(tiny_models["qwen3"], root, free_port(), ready))
    proc.start()
    deadline = time.monotonic() + 120
    while not ready.exists() and proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ready.exists(), "the saving process did not get to its background write"
    writer_line, helper_line = ready.read_text().split("\n")
    writers = [psutil.Process(int(pid)) for pid in writer_line.split()]
    assert len(writers) == 1 and writers[0].is_running()
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    _, alive = psutil.wait_procs(writers, timeout=10)
    for leftover in alive + [psutil.Process(int(pid)) for pid in helper_line.split()]:
        with contextlib.suppress(psutil.NoSuchProcess):  # megatron's manager does not die
            leftover.kill()
    assert not alive, "the background writer outlived its rank"
    names = sorted(p.name for p in root.iterdir())
    assert (root / "latest").read_text() == "step_00000001"
    assert "step_00000002" not in names
    assert any(n.startswith("step_00000002.tmp-") for n in names)
    step, after = pool1.run(load_then_save, tiny_models["qwen3"], root)[0]
    assert step == 1 and after == ["latest", "step_00000001", "step_00000003"]


def load_then_save(model_dir, root):
    """Run on one rank: resume from the latest checkpoint, then save step 3 (which removes
    what the interrupted save left)."""
    from megarl.megatron import checkpoint

    model = build(model_dir, ParallelSizes(), adam=False)
    loaded = checkpoint.load_checkpoint(root, model)
    with child_processes_allowed():
        checkpoint.save_checkpoint(root, model, 3)
    return loaded.step, sorted(p.name for p in root.iterdir())


def test_the_optimizers_collection_scans_only_its_own_objects_and_frees_the_rest_later():
    """megatron's optimizer state dict ends with a full ``gc.collect()``; inside
    ``_collections_see_only_new_objects`` that collection skips the objects that existed before
    (frozen), collects the cycles made inside, and afterwards nothing stays frozen: a cycle that
    was garbage before is collected by the next collection."""
    import gc
    import weakref

    from megarl.megatron.checkpoint_state import _collections_see_only_new_objects

    class Node:
        pass

    def cycle() -> weakref.ref:
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    gc.collect()
    frozen_before = gc.get_freeze_count()
    old = cycle()  # unreachable already, but only a collection frees a cycle
    with _collections_see_only_new_objects():
        assert gc.get_freeze_count() > frozen_before
        new = cycle()
        gc.collect()  # what megatron does
        assert new() is None and old() is not None  # the old objects were not scanned
    assert gc.get_freeze_count() == frozen_before
    gc.collect()
    assert old() is None
