"""The train-pool role: one ``ActorWorker`` per train rank, driven by the trainer.

Each worker joins the train pool's ``torch.distributed`` group, builds its shard of the Megatron
actor (and of the reference model when a KL term needs one) from the HF directory, and serves the
trainer's calls: log-probs of sequences, PPO updates on mini-batches, and streaming the updated
weights to the rollout engines. Data travels as plain Python lists so it crosses Ray cheaply;
MoE routes (router replay) as ragged int16 tensors ``[L_i, moe_layers, top_k]``, per sequence.
The trainer gives every rank of one data-parallel group the same share.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from megarl.cluster.worker import Worker
from megarl.megatron.checkpoint import (
    BackgroundSaves,
    SaveCache,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
    start_save,
)
from megarl.megatron.cuda_graphs import GraphedChunk, graph_unsupported_reason
from megarl.megatron.hf_export import copy_names, export_hf_weights, view_token
from megarl.megatron.logprobs import compute_log_probs
from megarl.megatron.lora import apply_lora, export_merged_weights, peft_adapter
from megarl.megatron.model import ActorModel, RecomputeSettings, build_actor_model
from megarl.megatron.offload import PARTS, StateOffloader
from megarl.megatron.optimizer import TrainableActor
from megarl.megatron.router_replay import ROUTER_REPLAY_OVERRIDES, RouteRecording
from megarl.megatron.router_replay import record_routes as record_routes_of
from megarl.megatron.router_replay import replay_routes as replay_routes_in
from megarl.megatron.settings import DTYPES, ActorSpec, LoraSettings
from megarl.megatron.update import TrainSequence, train_step
from megarl.memory import Peaks, free_cached_memory, phase_memory, settle_long_lived_objects
from megarl.weights.buckets import dtype_name
from megarl.weights.sglang_sender import (
    BucketSpec,
    ColocatedSender,
    Persist,
    broadcast_buckets,
)

logger = logging.getLogger(__name__)


def _as_tensor(values: list[float] | None) -> torch.Tensor | None:
    return None if values is None else torch.tensor(values, dtype=torch.float32)


def _first_of_group() -> bool:
    """Whether this rank reports results for its data-parallel group (TP, PP and CP rank 0)."""
    return (mpu.get_tensor_model_parallel_rank() == 0
            and mpu.get_pipeline_model_parallel_rank() == 0
            and mpu.get_context_parallel_rank() == 0)


def _replayed_routes(mini_batch: list[dict[str, Any]]) -> list[torch.Tensor] | None:
    """The ``routes`` of a mini-batch's records: None when none has any, else all of them."""
    routes = [s.get("routes") for s in mini_batch]
    if all(r is None for r in routes):
        return None
    if any(r is None for r in routes):
        raise ValueError("update: some sequences of a mini-batch carry routes and some do not; "
                         "router replay needs the routes of every sequence")
    return routes


class ActorWorker(Worker):
    """One rank of the Megatron actor (plus reference model) on the train pool."""

    def __init__(self, spec: ActorSpec) -> None:
        self.init_distributed()
        torch.manual_seed(spec.seed)
        self.spec = spec
        dtype = DTYPES[spec.dtype]
        model = self._build_model(dtype, router_replay=spec.router_replay,
                                  recompute=spec.recompute,
                                  lora=spec.lora if spec.lora.enabled else None)
        self.actor = TrainableActor(model, spec.optim, fuse_wgrad=not spec.cuda_graphs)
        self.graphed = self._graphed_chunk() if spec.cuda_graphs else None
        self.ref: ActorModel | None = None
        if spec.with_ref:
            self.ref = self._build_model(dtype)
        self.weight_group: dist.ProcessGroup | None = None
        self._colocated: tuple[Any, ColocatedSender] | None = None
        self._copy_names: tuple[Any, tuple[str, ...] | None] | None = None
        """((view token, id of the plan), names of the export's fresh tensors; None where the
        plan casts or quantizes a tensor) for the persistent sync."""
        self._plan: list[BucketSpec] | None = None
        """The colocated sync's bucket plan (the driver sends it once)."""
        self.offloader = StateOffloader(self.actor.model.chunks, self.actor.optimizer,
                                        stream_bytes=spec.offload.stream_bytes)
        self.ref_offloader = StateOffloader(self.ref.chunks if self.ref is not None else [])
        self.memory_peaks: Peaks = {}
        self.moving_seconds = {"offload_actor": 0.0, "reload_actor": 0.0}
        self.background_saves = BackgroundSaves()
        self.save_cache = SaveCache()
        if spec.ref_param_offload:
            self._move(self.ref_offloader, "offload", ["param"])
        self._move(self.offloader, "offload", spec.offload.parts())  # before engines start
        self.moving_seconds = dict.fromkeys(self.moving_seconds, 0.0)  # not a step's time
        settle_long_lived_objects()  # later hand-offs and saves collect only newer objects
        # what building the model and offloading freed goes back to the driver: colocated
        # engines start next and size their KV cache to what is free (the H200's dense run
        # kept 18 GB reserved here through step 1's generation, which ran out of memory)
        free_cached_memory()

    def _phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """A phase of this rank: its peak memory is recorded, an OOM names phase and knobs."""
        return phase_memory(name, f"actor rank {self.rank} (host {self.info.hostname})",
                            self.memory_peaks)

    def _move(self, offloader: StateOffloader, action: str, parts: Iterable[str]) -> int:
        """``offloader.offload`` or ``.reload`` (``action``) of ``parts``; the seconds it took
        count into ``timing/offload_actor`` or ``timing/reload_actor`` when bytes moved."""
        start = time.perf_counter()
        moved = getattr(offloader, action)(parts)
        if moved:
            kind = "reload" if action.startswith("reload") else action
            self.moving_seconds[f"{kind}_actor"] += time.perf_counter() - start
        return moved

    def offload(self, parts: list[str] | None = None) -> int:
        """Move ``parts`` of the actor's state (default: those ``actor.offload`` switches on)
        to host memory until a phase needs them; returns the bytes freed."""
        return self._move(self.offloader, "offload",
                          self.spec.offload.parts() if parts is None else parts)

    def reload(self, parts: list[str] | None = None) -> int:
        """Bring offloaded ``parts`` (default: all) back to the device; returns the bytes."""
        return self._move(self.offloader, "reload", PARTS if parts is None else parts)

    def free_cache(self) -> dict[str, int]:
        """Hand this process's cached, unused device blocks back to the driver (colocated: before
        the engines resume); the bytes it held ``before`` and ``after``."""
        return free_cached_memory()

    @contextlib.contextmanager
    def _resident(self) -> Iterator[None]:
        """The whole actor state on the device inside the block, offloaded again after it."""
        parts = sorted(self.offloader.offloaded)
        self._move(self.offloader, "reload", parts)
        try:
            yield
        finally:
            self._move(self.offloader, "offload", parts)

    def memory_stats(self) -> dict[str, Any]:
        """Since the last call (which clears them): per phase, the peak allocated and reserved
        GB and the GB in use on the device (``peaks``); the seconds spent offloading and
        reloading state (``seconds``: ``offload_actor``, ``reload_actor``)."""
        peaks, self.memory_peaks = self.memory_peaks, {}
        seconds = self.moving_seconds
        self.moving_seconds = dict.fromkeys(seconds, 0.0)
        return {"peaks": peaks, "seconds": seconds}

    def _build_model(self, dtype: torch.dtype, router_replay: bool = False,
                     recompute: RecomputeSettings | None = None,
                     lora: LoraSettings | None = None) -> ActorModel:
        """This rank's model chunks with the first weights (HF safetensors or dist checkpoint);
        with ``router_replay``, routers that can record and replay routes; with ``recompute``,
        activation recomputation; with ``lora``, LoRA adapters (native spec), which a dist
        checkpoint that holds adapters sets too."""
        spec = self.spec
        overrides = dict(ROUTER_REPLAY_OVERRIDES) if router_replay else {}
        overrides.update(recompute.config_overrides() if recompute is not None else {})
        model = build_actor_model(spec.model_path, spec.sizes, dtype, seed=spec.seed,
                                  load_weights=spec.init_checkpoint is None,
                                  config_overrides=overrides,
                                  trust_remote_code=spec.trust_remote_code,
                                  spec="native" if lora else "auto")
        if lora is not None:
            apply_lora(model, lora)
        if spec.init_checkpoint is not None:
            load_model_weights(spec.init_checkpoint, model)
        return model

    def _graphed_chunk(self) -> GraphedChunk | None:
        """The actor chunk's CUDA-graphed training forward (None, with a warning, where the
        layout or the device rules graphs out)."""
        reason = graph_unsupported_reason(self.actor.model.config, self.spec.sizes.pp,
                                          self.spec.router_replay)
        if reason is not None:
            logger.warning("actor.cuda_graphs is on but the update runs eagerly: %s", reason)
            return None
        return GraphedChunk(self.actor.model.chunks[0],
                            bucket_tokens=self.spec.cuda_graph_bucket_tokens)

    def layout(self) -> dict[str, int]:
        """This rank's data-parallel coordinates and whether it reports results for its group."""
        return {"dp_rank": mpu.get_data_parallel_rank(), "dp_size": mpu.get_data_parallel_world_size(),
                "reports": int(_first_of_group())}

    def compute_log_probs(self, sequences: list[list[int]], use_ref: bool = False,
                          with_entropy: bool = False, routes: list[torch.Tensor] | None = None,
                          record_routes: bool = False) -> dict[str, list]:
        """Log-probs (and entropy) of every token of this rank's sequences (entry 0 is 0).

        ``routes`` (per sequence ``[L_i or L_i - 1, moe_layers, top_k]``, -1 rows native) are
        replayed in the forward; with ``record_routes`` the result's ``routes`` hold the int16
        routes the forward used, per sequence ``[L_i, moe_layers, top_k]``.
        """
        model = self.ref if use_ref else self.actor.model
        assert model is not None, "reference model requested but not built"
        offloader = self.ref_offloader if use_ref else self.offloader
        budget = (self.spec.ref_max_tokens_per_micro_batch if use_ref
                  else self.spec.log_prob_max_tokens_per_micro_batch)
        budget = budget or self.spec.max_tokens_per_micro_batch
        tokens = [torch.tensor(s, dtype=torch.long) for s in sequences]
        for chunk in model.chunks:
            chunk.eval()
        with self._phase("ref" if use_ref else "old_log_prob"):
            self._move(offloader, "reload", ["param"])
            with self._routing(model, tokens, routes, record_routes, budget) as recording, \
                    torch.no_grad():
                out = compute_log_probs(
                    model, tokens, temperature=self.spec.temperature, with_entropy=with_entropy,
                    max_tokens_per_micro_batch=budget)
            if use_ref and self.spec.ref_param_offload:
                self._move(offloader, "offload", ["param"])
        result: dict[str, list] = {"log_probs": [lp.float().tolist() for lp in out.log_probs]}
        if with_entropy and out.entropy is not None:
            result["entropy"] = [e.float().tolist() for e in out.entropy]
        if record_routes:  # only the reporting ranks send routes back (they are large)
            result["routes"] = recording.routes if _first_of_group() else []
        return result

    @contextlib.contextmanager
    def _routing(self, model: ActorModel, tokens: list[torch.Tensor],
                 routes: list[torch.Tensor] | None, record: bool,
                 budget: int | None) -> Iterator[RouteRecording]:
        """Replay ``routes`` and/or record the routes of the one forward run in the block, which
        packs micro-batches of ``budget`` tokens."""
        if routes is not None:
            with replay_routes_in(model, tokens, routes, max_tokens_per_micro_batch=budget,
                                  record=record) as recording:
                yield recording
        elif record:
            with record_routes_of(model, tokens, max_tokens_per_micro_batch=budget) as recording:
                yield recording
        else:
            yield RouteRecording()

    def update(self, mini_batches: list[list[dict[str, Any]]]) -> list[dict[str, float]]:
        """One optimizer step per mini-batch of this rank's sequences; metrics per step.
        Sequences that carry ``routes`` are routed with them (router replay)."""
        return self.update_recording_routes(mini_batches, record_routes=False)[0]

    def update_recording_routes(
        self, mini_batches: list[list[dict[str, Any]]], record_routes: bool = True
    ) -> tuple[list[dict[str, float]], list[list[torch.Tensor]]]:
        """As :meth:`update`; also returns, per mini-batch, the int16 routes each sequence's
        update forward used (``[L_i, moe_layers, top_k]``; empty lists unless recorded)."""
        metrics, used = [], []
        deferred = self.spec.offload.optimizer_offload  # on the device for the steps only
        with self._phase("update_actor"):
            self._move(self.offloader, "reload", self.spec.offload.update_parts())
            for index, mini_batch in enumerate(mini_batches):
                if deferred and index:
                    self._move(self.offloader, "offload", ["optimizer"])
                metrics.append(self._update_one(mini_batch, record_routes, used, deferred))
        return metrics, used

    def _update_one(self, mini_batch: list[dict[str, Any]], record_routes: bool,
                    used: list[list[torch.Tensor]], deferred: bool) -> dict[str, float]:
        """One optimizer step on one mini-batch; appends the routes it used to ``used``;
        ``deferred``: the optimizer state comes back after the last backward."""
        sequences = [
            TrainSequence(
                tokens=torch.tensor(s["tokens"], dtype=torch.long),
                loss_mask=torch.tensor(s["loss_mask"], dtype=torch.float32),
                old_log_probs=_as_tensor(s["old_log_probs"]),
                advantages=_as_tensor(s["advantages"]),
                ref_log_probs=_as_tensor(s.get("ref_log_probs")),
                rollout_is_weights=_as_tensor(s.get("rollout_is_weights")),
            )
            for s in mini_batch
        ]
        with self._routing(self.actor.model, [s.tokens for s in sequences],
                           _replayed_routes(mini_batch), record_routes,
                           self.spec.max_tokens_per_micro_batch) as recording:
            result = train_step(
                self.actor, sequences, self.spec.loss,
                max_tokens_per_micro_batch=self.spec.max_tokens_per_micro_batch,
                temperature=self.spec.temperature, graphed=self.graphed,
                before_step=(partial(self._move, self.offloader, "reload_for_step", ["optimizer"])
                             if deferred else None))
        used.append(recording.routes)
        return result

    def save_checkpoint(self, root: str, step: int, extra: dict[str, Any],
                        keep_last: int | None, background: bool = False) -> str:
        """Save model, optimizer, LR schedule and RNG states of every rank at ``step`` under
        ``root`` (atomic, ``latest`` updated last); collective. Returns the directory. With
        ``background`` it returns once the state is staged in host memory; the files are
        written by a forked process and :meth:`finish_checkpoint` publishes them (a pending
        save is published first)."""
        self.background_saves.finish()
        with self._resident():
            if not background:
                return str(save_checkpoint(root, self.actor, step, extra=extra,
                                           keep_last=keep_last, cache=self.save_cache))
            pending = start_save(root, self.actor, step, extra=extra, keep_last=keep_last,
                                 cache=self.save_cache)
            self.background_saves.submit(pending)
        return str(pending.final)

    def finish_checkpoint(self) -> str | None:
        """Wait for a background save's files and publish it (collective); its directory, or
        None when none was pending."""
        path = self.background_saves.finish()
        return None if path is None else str(path)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Restore the actor from a checkpoint (a directory or a root's latest); collective.
        The reference model keeps its initial weights. Returns the step and ``extra``."""
        self.background_saves.finish()
        with self._resident():
            loaded = load_checkpoint(path, self.actor)
        return {"path": str(loaded.path), "step": loaded.step, "extra": loaded.extra,
                "optimizer_restored": loaded.optimizer_restored,
                "rng_restored": loaded.rng_restored}

    def _export(self, copies_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named tensors of the actor (parameters brought back first if offloaded);
        ``copies_only``: those that are not views of a parameter (hf_export's)."""
        with self._phase("sync_weights"):
            self._move(self.offloader, "reload", ["param"])
            model = self.actor.model
            if self.spec.lora.enabled:  # W + scale * B @ A under the base names
                yield from export_merged_weights(model)
            else:
                yield from export_hf_weights(model, copies_only)

    def _persist(self, sender: ColocatedSender, plan: list[BucketSpec]) -> Persist | None:
        """What lets the engine keep this rank's views between syncs (the sender's
        ``persist``), or None where it cannot: LoRA's merged export makes every tensor afresh,
        an offloaded parameter comes back elsewhere, a plan that casts or quantizes a tensor
        sends a new one every sync, an engine of several GPUs or a SGLang server takes packed
        buckets only."""
        model = self.actor.model
        if (self.spec.lora.enabled or self.spec.offload.param_offload
                or not sender.persistent_engine()):
            return None
        token = view_token(model)
        if token is None:
            return None
        if self._copy_names is None or self._copy_names[0] != (token, id(plan)):
            dtypes = {name: dtype_name(t.dtype) for name, t in export_hf_weights(model)}
            casts = any(dtypes.get(name) != dtype for bucket in plan for name, _, dtype in bucket)
            self._copy_names = ((token, id(plan)), None if casts else tuple(copy_names(model)))
        if self._copy_names[1] is None:
            return None
        return Persist(token, token[1], self._copy_names[1],
                       lambda: self._export(copies_only=True))

    def lora_adapter(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
        """The adapters in PEFT's format (``adapter_config.json``, state dict on the CPU), for
        the adapter sync; collective, rank 0 gets them (the others None)."""
        with self._phase("sync_weights"):
            self._move(self.offloader, "reload", ["param"])
            adapter = peft_adapter(self.actor.model, self.spec.lora)
        if adapter is None:
            return None
        config, tensors = adapter
        return config, {name: t.detach().cpu() for name, t in tensors.items()}

    def weight_specs(self) -> list[tuple[str, list[int]]]:
        """HF names and shapes of every exported tensor, in export order (collective)."""
        return [(name, list(tensor.shape)) for name, tensor in self._export()]

    def weight_group_address(self) -> tuple[str, int]:
        """This node's IP and a free port for the weight-update group's rendezvous."""
        from megarl.net import free_port

        return self.info.node_ip, free_port("0.0.0.0")

    def open_weight_group(self, master_address: str, master_port: int, world_size: int,
                          backend: str) -> None:
        """Rank 0 creates the weight-update group as its rank 0; the engines join it."""
        if self.rank != 0:
            return
        from megarl.weights.group import open_weight_update_group

        self.weight_group = open_weight_update_group(
            master_address, master_port, rank=0, world_size=world_size, backend=backend)

    def close_weight_group(self) -> None:
        """Leave the weight-update group (before it is re-formed after an engine restart)."""
        if self.weight_group is not None:
            from megarl.weights.group import close_weight_update_group

            close_weight_update_group(self.weight_group)
            self.weight_group = None

    def broadcast_weights(self, plan: list[BucketSpec]) -> int:
        """Export HF-named tensors (collective over the train pool); rank 0 broadcasts each
        bucket of ``plan`` (in its dtypes, or quantized to block FP8) as one flat buffer over
        the weight group (SGLang's ``flattened_bucket``). Returns the bytes sent."""
        group = self.weight_group if self.rank == 0 else None
        return broadcast_buckets(self._export(), plan, group, torch.device(self.device))

    def send_weights_colocated(self, plan: list[BucketSpec] | None, urls: list[str],
                               gpus_per_engine: int, version: str, api_key: str | None,
                               timeout_s: float) -> dict[str, float]:
        """Export HF-named tensors (collective) and hand each bucket of ``plan`` to the engine
        sharing this rank's GPU through SGLang's ``/update_weights_from_tensor`` (CUDA IPC
        handles; inline bytes on CPU), or with an embedded engine as views it keeps from the
        first sync on (:meth:`_persist`). Returns the bytes this rank sent, the seconds spent
        packing and waiting for the engine, and whether the engine replayed its kept views.
        ``plan`` None: the last one given (the driver sends it once)."""
        if plan is not None:
            self._plan = plan
        elif self._plan is None:
            raise RuntimeError("send_weights_colocated: no bucket plan was given to this rank")
        plan = self._plan
        key = (tuple(urls), gpus_per_engine)
        if self._colocated is None or self._colocated[0] != key:
            if self._colocated is not None:
                self._colocated[1].close()
            sender = ColocatedSender(self.rank, self.world_size, urls, gpus_per_engine,
                                     api_key=api_key, timeout_s=timeout_s)
            self._colocated = (key, sender)
        sender = self._colocated[1]
        sent = sender.send(self._export(), plan, torch.device(self.device), version,
                           persist=self._persist(sender, plan))
        return {"bytes": float(sent), "replayed": float(sender.posts["replayed"]),
                **{f"{k}_s": v for k, v in sender.seconds.items()}}

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model in HF names (rank 0's copy; for tests and checks on tiny models)."""
        return {name: tensor.detach().cpu().clone() for name, tensor in self._export()}
