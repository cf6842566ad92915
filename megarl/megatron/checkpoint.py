"""Actor checkpoints: model, optimizer, LR schedule progress, RNG states, step and the trainer's
``extra`` state, saved with megatron-core dist-checkpointing and published atomically.

A checkpoint root holds one directory per saved step and a pointer to the newest one::

    <root>/step_00000012/   megatron dist checkpoint (metadata.json, .metadata, *.distcp,
                            common.pt) and megarl.json (step, model fingerprint, layout)
    <root>/latest           "step_00000012"

(:mod:`megarl.megatron.checkpoint_dirs` holds these names, without megatron-core.)

Saving writes into ``<root>/step_00000012.tmp-<id>``; once every rank has written its shards
(barrier), rank 0 renames it to its final name, then replaces ``latest`` (temporary file +
``os.replace``), then removes the oldest directories beyond ``keep_last``. A crash at any point
leaves ``latest`` on the previous complete checkpoint; the stale temporary directory is removed
by the next save. Every rank must see the same file system path (one writer per root).

A save can also run in the background (:class:`BackgroundSaves`, ``trainer.async_save``;
PITFALLS M2): :func:`start_save` plans the checkpoint and stages every tensor in host memory
(collective), megatron-core's :class:`AsyncCallsQueue` writes each rank's files from a forked
process (a snapshot of the staged state; the trainer's process holds no lock while it writes,
and the writer dies with it), and :meth:`BackgroundSaves.finish` (collective) waits for the
writes and publishes exactly as above. Until then ``latest`` names the previous checkpoint.

Tensors are saved as global tensors (``sharded_state_dict``: TP/PP/EP shards with their
offsets), so a checkpoint loads under another TP/PP/EP/DP layout; the optimizer state uses the
distributed optimizer's ``fully_reshardable`` format (per parameter, in model space). RNG
states are per rank and restored only under the same layout and world size. What a checkpoint
holds (fingerprint, layout, sharded state) is built in :mod:`megarl.megatron.checkpoint_state`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import multiprocessing as mp
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megarl.children import die_with_parent
from megarl.faults import checkpoint_write_delay
from megarl.megatron import cpu_compat
from megarl.megatron.checkpoint_dirs import (
    LATEST,
    MANIFEST,
    latest_checkpoint,
    list_checkpoints,
    step_dir_name,
)
from megarl.megatron.checkpoint_state import (
    OPTIMIZER_METADATA,
    chunk_modules,
    current_layout,
    model_fingerprint,
    restore_rng_state,
    sharded_actor_state,
    sharded_model_state,
)
from megarl.megatron.model import ActorModel, load_hf_config
from megarl.megatron.optimizer import TrainableActor

FORMAT_VERSION = 1
# written next to a model-only checkpoint by ``megarl-convert hf-to-mcore`` (bridge/)
CONVERTED_INFO = "megarl_convert.json"
_LEFTOVER_DIR = re.compile(r"^step_\d{8}\.(tmp|old)-[0-9a-f]+$")


@dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` restored."""

    path: Path
    """The checkpoint directory."""
    step: int
    """The step it was saved at."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The ``extra`` dict given to :func:`save_checkpoint`."""
    optimizer_restored: bool = False
    """Whether optimizer state and LR-schedule progress were loaded."""
    rng_restored: bool = False
    """Whether RNG states were restored (same layout and world size only)."""


def _agreed_token() -> str:
    """A random id chosen on rank 0 and shared with every rank."""
    token = [uuid.uuid4().hex[:12] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    return token[0]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save_checkpoint(
    root: str | Path,
    target: ActorModel | TrainableActor,
    step: int,
    *,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
    cache: SaveCache | None = None,
) -> Path:
    """Save ``target`` (its optimizer and LR schedule too for a TrainableActor), the RNG states,
    ``step`` and ``extra`` under ``root``; collective over all ranks. ``extra`` must be picklable
    and the same on every rank (rank 0's is stored). Keeps the newest ``keep_last`` checkpoints
    (all if None). Successive saves of one model may share a ``cache``. Returns the published
    directory."""
    pending = start_save(root, target, step, extra=extra, keep_last=keep_last, cache=cache)
    pending.request.execute_sync()  # write, barrier, then every finalize (publication last)
    return pending.final


class _FreshDirectoryFilter(logging.Filter):
    """Drops megatron's "Overwriting old incomplete / corrupted checkpoint" warning: megarl saves
    into a fresh temporary directory, which another rank may have begun to fill (with a cached
    save plan no collective holds it back) before rank 0 looks."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Keep every record but that warning."""
        return "Overwriting old incomplete" not in record.getMessage()


logging.getLogger(dist_checkpointing.serialization.__name__).addFilter(_FreshDirectoryFilter())


class SaveCache:
    """What successive saves of one model (same layout, same state structure) reuse: megatron's
    torch_dist strategy with its cached save plan (``cached_metadata``: megatron checks the plan
    is unchanged before it reuses it) and the sharding validated by the first save only."""

    def __init__(self) -> None:
        self.strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
        self.validated = False


@dataclass
class PendingSave:
    """A checkpoint planned and staged by :func:`start_save`, not yet written."""

    final: Path
    """The directory it is published as."""
    request: AsyncRequest
    """megatron-core's request: the write (``async_fn``) and the collective finalize functions,
    whose last one publishes the checkpoint."""


_WRITE_RESULTS_MANAGER: Any = None


def write_results_queue_dies_with_this_process() -> int:
    """Give megatron's async filesystem writer a results queue whose manager process dies with
    this one; returns that process's pid.

    megatron creates the queue lazily in a module global, from a ``spawn`` manager process that
    outlives a SIGKILLed rank (Ray kills workers so), one orphan per rank per run. Started here
    on megarl's spawner thread with ``PR_SET_PDEATHSIG`` set in the manager, it goes with the
    process; megatron then finds its global already set.

    The manager is forked, not spawned (megatron's writers fork from the rank as well): a
    spawned one first imports the rank's ``__main__`` and, at the first result it unpickles,
    torch's checkpoint classes, which made every run's first save 1.8 s slower on 2 CPU cores
    (the writer waits on that ``put``); a forked one has them already."""
    global _WRITE_RESULTS_MANAGER
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if _WRITE_RESULTS_MANAGER is None:
        from multiprocessing.managers import SyncManager

        from megarl.children import die_with_parent, in_spawner_thread

        manager = SyncManager(ctx=mp.get_context("fork"))
        in_spawner_thread(manager.start, die_with_parent, (os.getpid(),))
        filesystem_async._results_queue = manager.Queue()
        _WRITE_RESULTS_MANAGER = manager
    return _WRITE_RESULTS_MANAGER._process.pid


def start_save(
    root: str | Path,
    target: ActorModel | TrainableActor,
    step: int,
    *,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
    cache: SaveCache | None = None,
) -> PendingSave:
    """The collective first half of :func:`save_checkpoint`: a temporary directory, rank 0's
    common state written, the dist checkpoint planned; the tensors are staged to host memory
    when the request is executed or scheduled. Nothing is published before the request's
    finalize functions run."""
    cpu_compat.enable()
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: keep at least 1 checkpoint, or None for all")
    write_results_queue_dies_with_this_process()
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f"{final.name}.tmp-{_agreed_token()}"
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(root)
        tmp.mkdir()
    dist.barrier()
    model = target.model if isinstance(target, TrainableActor) else target
    actor = target if isinstance(target, TrainableActor) else None
    with_optimizer = actor is not None and _has_state(actor)
    state = sharded_actor_state(target, with_optimizer, with_rng=True, loading=False)
    state["megarl"] = {"step": step, "extra": dict(extra or {})}
    if actor is not None:
        state["megarl"]["scheduler"] = actor.scheduler.state_dict()
    request = dist_checkpointing.save(
        state, str(tmp), sharded_strategy=None if cache is None else cache.strategy,
        validate_access_integrity=cache is None or not cache.validated, async_sharded_save=True)
    if cache is not None:
        cache.validated = True
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "model": model_fingerprint(model.hf_config),
        "layout": current_layout(),
        "has_optimizer": with_optimizer,
        # what built the adapters, for exporting them (megarl-convert lora-to-peft)
        "lora": None if model.lora is None else dataclasses.asdict(model.lora),
    }
    request.add_finalize_fn(functools.partial(_finalize_publication, tmp, final, manifest,
                                              keep_last))
    return PendingSave(final, request)


def _finalize_publication(tmp: Path, final: Path, manifest: dict[str, Any],
                          keep_last: int | None) -> None:
    """Collective, once every rank's files and the dist checkpoint's metadata are written:
    rank 0 writes megarl.json, renames the directory, moves ``latest``, rotates."""
    dist.barrier()
    if dist.get_rank() == 0:
        _write_file_atomically(tmp / MANIFEST, json.dumps(manifest, indent=2))
        _publish(tmp, final)
        _write_file_atomically(final.parent / LATEST, final.name)
        if keep_last is not None:
            _rotate(final.parent, keep_last, keep=final)
    dist.barrier()


def _write_in_child(parent_pid: int, delay_s: float, write: Callable[..., None],
                    *args: Any, **kwargs: Any) -> None:
    """The body of a background writer process (forked from a rank): die with the rank, and
    have the processes megatron forks for each file die with this one; wait ``delay_s`` (the
    tests' slow file system, ``MEGARL_CKPT_WRITE_DELAY_S``), then write."""
    die_with_parent(parent_pid)
    os.register_at_fork(after_in_child=die_with_parent)
    if delay_s > 0:
        time.sleep(delay_s)
    write(*args, **kwargs)


class BackgroundSaves:
    """Checkpoints of one model written in the background, one at a time, published in order.

    :meth:`submit` (collective) stages a :class:`PendingSave`'s tensors in host memory and
    forks the process that writes this rank's files (megatron-core's ``AsyncCallsQueue``);
    training may change the weights at once. :meth:`finish` (collective) waits for every
    rank's writer, completes the dist checkpoint's metadata and publishes it."""

    def __init__(self) -> None:
        self.queue = AsyncCallsQueue(persistent=False)
        self.pending: Path | None = None

    def submit(self, pending: PendingSave) -> None:
        """Start writing ``pending`` (after publishing the previous save); collective."""
        self.finish()
        request = pending.request
        if request.async_fn is not None:
            request = request._replace(async_fn=functools.partial(
                _write_in_child, os.getpid(), checkpoint_write_delay(), request.async_fn))
        self.queue.schedule_async_request(request)
        self.pending = pending.final

    def finish(self) -> Path | None:
        """Wait for the pending save's writes and publish it (collective); its directory, or
        None when none was pending. A failed write raises here, on every rank."""
        pending, self.pending = self.pending, None
        self.queue.maybe_finalize_async_calls(blocking=True)
        return pending


def _publish(tmp: Path, final: Path) -> None:
    """Rename the fully written ``tmp`` directory to ``final`` (replacing an older save of the
    same step)."""
    if final.exists():
        old = final.with_name(f"{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    _fsync_dir(final.parent)


def _remove_stale_temporaries(root: Path) -> None:
    """Clean up after interrupted saves: remove ``.tmp-`` directories (never published) and
    ``.old-`` ones (replaced by a newer save of their step), or put an ``.old-`` one back if the
    save that replaced it stopped before publishing."""
    for path in root.iterdir():
        match = _LEFTOVER_DIR.match(path.name)
        if match is None:
            continue
        final = root / path.name.split(".")[0]
        if match.group(1) == "old" and not final.exists():
            os.rename(path, final)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _rotate(root: Path, keep_last: int, keep: Path) -> None:
    """Remove the oldest complete checkpoints beyond ``keep_last`` (never ``keep``)."""
    complete = list_checkpoints(root)
    for path in complete[: max(len(complete) - keep_last, 0)]:
        if path != keep:
            shutil.rmtree(path)


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The ``megarl.json`` of a checkpoint directory."""
    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        raise FileNotFoundError(
            f"{manifest}: not a megarl checkpoint directory (no {MANIFEST}); pass a directory "
            "written by save_checkpoint or its root"
        )
    return json.loads(manifest.read_text())


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory itself, or the latest checkpoint of a root."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(
            f"{path}: no checkpoint found (neither {MANIFEST} nor step_* directories with one); "
            "check the checkpoint path"
        )
    return latest


def check_same_model(saved: dict[str, Any], hf_config: Any, path: Path) -> None:
    """Raise ValueError naming every architecture field that differs from the checkpoint's."""
    current = model_fingerprint(hf_config)
    differing = [
        f"{name}: checkpoint {saved.get(name)!r}, model {current.get(name)!r}"
        for name in sorted(set(saved) | set(current))
        if saved.get(name) != current.get(name)
    ]
    if differing:
        raise ValueError(
            f"checkpoint {path} was saved from a different model ("
            + "; ".join(differing)
            + "); load it into a model built from the same HF config, or use another "
            "checkpoint directory"
        )


def load_checkpoint(
    path: str | Path,
    target: ActorModel | TrainableActor,
    *,
    load_optimizer: bool = True,
    load_rng: bool = True,
) -> LoadedCheckpoint:
    """Load a checkpoint (a directory, or a root's latest) into ``target``, under any layout;
    collective over all ranks. A TrainableActor also gets its optimizer state and LR-schedule
    progress (if saved and ``load_optimizer``); RNG states come back only under the saved
    layout."""
    cpu_compat.enable()
    path = resolve_checkpoint(path)
    manifest = read_manifest(path)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}/{MANIFEST}: format_version {manifest.get('format_version')} is not "
            f"{FORMAT_VERSION}; it was written by another megarl version"
        )
    model = target.model if isinstance(target, TrainableActor) else target
    check_same_model(manifest["model"], model.hf_config, path)
    actor = target if isinstance(target, TrainableActor) else None
    with_optimizer = (
        load_optimizer and actor is not None and _has_state(actor) and manifest["has_optimizer"]
    )
    with_rng = load_rng and manifest["layout"] == current_layout()
    if with_optimizer:
        _initialise_adam_state(actor)
    request = sharded_actor_state(target, with_optimizer, with_rng, loading=True)
    loaded = dist_checkpointing.load(request, str(path))
    modules = chunk_modules(model)
    for i, module in enumerate(modules):
        module.load_state_dict(loaded["model" if len(modules) == 1 else f"model{i}"])
    common = loaded["megarl"]
    if with_optimizer:
        _load_optimizer_state(actor, loaded["optimizer"])
    elif actor is not None:
        # main (fp32) copies of low-precision parameters follow the loaded weights
        actor.optimizer.reload_model_params()
    if actor is not None and load_optimizer and "scheduler" in common:
        _restore_schedule_progress(actor, common["scheduler"])
    if with_rng:
        restore_rng_state(loaded["rng_state"])
    return LoadedCheckpoint(
        path=path,
        step=int(common["step"]),
        extra=common["extra"],
        optimizer_restored=with_optimizer,
        rng_restored=with_rng,
    )


def _converted_model_fingerprint(path: Path) -> dict[str, Any] | None:
    """Architecture of the HF config kept next to a ``megarl-convert hf-to-mcore`` checkpoint,
    or None when ``path`` is not one."""
    if not (path / CONVERTED_INFO).is_file():
        return None
    config = path / "hf" / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{config}: missing from the converted checkpoint {path}; "
                                "convert the model again with megarl-convert hf-to-mcore")
    return model_fingerprint(load_hf_config(config.parent))


def load_model_weights(path: str | Path, model: ActorModel) -> Path:
    """Load only the model weights of a dist checkpoint into ``model`` under any layout: a
    checkpoint written by ``megarl-convert hf-to-mcore``, or a megarl training checkpoint (a
    directory or a root's latest). Collective over all ranks; returns the directory read."""
    cpu_compat.enable()
    path = Path(path)
    saved = _converted_model_fingerprint(path)
    if saved is None:
        path = resolve_checkpoint(path)
        saved = read_manifest(path)["model"]
    check_same_model(saved, model.hf_config, path)
    request = sharded_model_state(model)
    fresh = _adapters_to_keep(request, path)
    loaded = dist_checkpointing.load(request, str(path))
    modules = chunk_modules(model)
    for i, module in enumerate(modules):
        missing, unexpected = module.load_state_dict(
            loaded["model" if len(modules) == 1 else f"model{i}"], strict=False)
        if set(missing) - fresh or unexpected:
            raise RuntimeError(f"{path}: loading the model weights left {sorted(missing)} "
                               f"unset and {sorted(unexpected)} unused")
    return path


def _adapters_to_keep(request: dict[str, Any], path: Path) -> set[str]:
    """LoRA adapters (``.lora.`` names) of the model that the checkpoint lacks: dropped from
    ``request``, so they keep their initial values (LoRA on a full-weight checkpoint). The
    checkpoint's adapters that the model lacks would be lost: refused."""
    stored = set(dist_checkpointing.load_tensors_metadata(str(path)))
    keep = set()
    for part in request.values():
        for name in [n for n, t in part.items() if ".lora." in n and t.key not in stored]:
            del part[name]
            keep.add(name)
    wanted = any(".lora." in n for part in request.values() for n in part)
    if not wanted and not keep and any(".lora." in k for k in stored):
        raise ValueError(f"{path}: the checkpoint holds LoRA adapters, the model none; set "
                         "actor.lora as in the run that wrote it to start from base and adapters")
    return keep


def _has_state(actor: TrainableActor) -> bool:
    """Whether the optimizer keeps per-parameter state (Adam; plain SGD keeps none)."""
    return actor.settings.optimizer == "adam"


def _initialise_adam_state(actor: TrainableActor) -> None:
    """Give every parameter of a never-stepped Adam a zero state with ``step``, as its first
    step would: megatron's distributed optimizer reads ``step`` from the state when it builds
    the state dict to load into (without TE or apex)."""
    chain = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    for opt in chain:
        inner = opt.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)


def _load_optimizer_state(actor: TrainableActor, state: dict[str, Any]) -> None:
    """``actor.optimizer.load_state_dict(state)``, working around megatron-core 0.16's
    distributed optimizer without TE or apex: torch Adam keeps ``step`` in each parameter's
    state, which the ``fully_reshardable`` loader expects to find in the checkpoint's
    per-parameter tensors too (it keeps it in the param groups), and it gives all parameters
    one shared ``step`` tensor. The parameter state is loaded with ``step`` set aside, then
    each parameter gets its own copy."""
    chain = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    parts = [state] if len(chain) == 1 else [v for _, v in sorted(state.items())]
    for opt, part in zip(chain, parts):
        if not isinstance(opt, DistributedOptimizer):
            opt.load_state_dict(part)
            continue
        param_state = part.pop("param_state")
        sharding = part.pop("param_state_sharding_type")
        if sharding != OPTIMIZER_METADATA["distrib_optim_sharding_type"]:
            raise ValueError(
                f"optimizer state saved as {sharding!r}; megarl checkpoints use "
                f"{OPTIMIZER_METADATA['distrib_optim_sharding_type']!r}"
            )
        opt.load_state_dict(part)
        steps = {p: st.pop("step") for p, st in opt.optimizer.state.items() if "step" in st}
        opt.load_parameter_state_from_fully_reshardable(param_state)
        for param, step in steps.items():
            # megatron hands every parameter the same step tensor; torch Adam increments each
            # parameter's step in place, so they must not alias
            opt.optimizer.state[param]["step"] = step.clone()


def _restore_schedule_progress(actor: TrainableActor, saved: dict[str, Any]) -> None:
    """Advance the LR schedule to the saved step count; the schedule's shape (peak LR, warm-up,
    decay) stays the one configured now."""
    scheduler = actor.scheduler
    scheduler.step(increment=int(saved["num_steps"]) - scheduler.num_steps)
