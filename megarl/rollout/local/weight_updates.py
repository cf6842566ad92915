"""The receiving half of weight updates in the embedded engine.

Tensors arrive by broadcast over a weight-update process group (``/init_weights_update_group``
then one ``/update_weights_from_distributed`` per bucket), as serialized tensors
(``/update_weights_from_tensor``) or from an HF directory (``/update_weights_from_disk``).
Receiving happens on the caller's thread; the copy into the model happens on the engine thread
between generation steps (:meth:`LocalEngine.call`), so no forward sees half a bucket. A
``flattened_bucket`` is copied by a :class:`~megarl.rollout.local.bucket_loader.BucketLoader`,
which plans each distinct bucket once; megarl's colocated sender may have the engine keep its
payloads and copy them in again at later syncs (:class:`Programs`). Every method returns
``(success, message)`` like SGLang's endpoints.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megarl.rollout.local.bucket_loader import (
    BucketLoader,
    BucketRecords,
    LoadPlan,
    bucket_records,
)
from megarl.rollout.local.engine import LocalEngine
from megarl.rollout.local.weights import (
    WeightsChecker,
    iter_safetensors,
)
from megarl.rollout.weight_group import (
    close_weight_update_group,
    open_weight_update_group,
    parse_dtype,
)
from megarl.weights.flattened import FLATTENED_BUCKET, bucket_metadata, deserialize, unflatten

Outcome = tuple[bool, str]


class Programs:
    """Payloads an engine keeps to copy in again at later syncs (megarl's colocated sender).

    A colocated train rank's parameters live in the same GPU memory from sync to sync, and a
    ``flattened_bucket`` whose flat tensor is a view of that memory (opened through CUDA IPC)
    can be read again at the next sync: the sender then sends no views at all, only what its
    export makes afresh (a split QKV), with ``megarl_replay`` naming the program. ``megarl_keep``
    (``{"program": name, "part": k}``) keeps a payload as part k of a program; part 0 starts
    it anew (a sender registers again whenever its memory moved) and drops every other
    program, so an engine holds the memory of one sender's registration at most. Only CUDA
    and CPU shared-memory payloads can be kept: an inline CPU payload's bytes are a copy made
    when it was sent. Both fields are megarl's own (SGLang knows neither), so the sender uses
    them only with an engine whose ``/get_server_info`` says ``version: megarl-embedded``.
    """

    def __init__(self) -> None:
        self._held: dict[str, list[KeptPart]] = {}

    def parts(self, name: Any) -> list[KeptPart] | None:
        """The kept parts of program ``name``, in order, or None when none is held."""
        return list(self._held[name]) if isinstance(name, str) and name in self._held else None

    def check(self, mark: Any, payload: dict[str, Any] | None) -> None:
        """Raise ``ValueError`` unless ``mark`` is ``{"program": str, "part": int}`` and
        ``payload`` can be kept as that part (the next part of the program, in the sender's
        memory)."""
        if (not isinstance(mark, dict) or not isinstance(mark.get("program"), str)
                or not isinstance(mark.get("part"), int) or isinstance(mark.get("part"), bool)):
            raise ValueError(  # noqa: TRY004 - answered as a failed update, as SGLang does
                f"megarl_keep: {mark!r} must be {{'program': str, 'part': int}}")
        flat = None if payload is None else payload["flattened_tensor"]
        if flat is None or not (flat.is_cuda or flat.untyped_storage().is_shared()):
            raise ValueError("megarl_keep: only a payload in the sender's memory can be kept "
                             "(CUDA IPC or CPU shared memory); its bytes were copied when "
                             "sent: send it without megarl_keep")
        have = 0 if mark["part"] == 0 else len(self._held.get(mark["program"], []))
        if mark["part"] != have:
            raise ValueError(f"megarl_keep: part {mark['part']} of {mark['program']!r} follows "
                             f"{have} kept parts; register from part 0 again")

    def keep(self, mark: dict[str, Any], part: KeptPart) -> None:
        """Keep a checked payload (after it loaded) as ``mark`` says."""
        if mark["part"] == 0:
            self._held = {mark["program"]: []}
        self._held[mark["program"]].append(part)


@dataclass(frozen=True)
class KeptPart:
    """A kept payload, its copy plan and the sources of its copies (views of its flat tensor,
    valid while it is kept)."""

    payload: dict[str, Any]
    plan: LoadPlan
    sources: list[torch.Tensor]


class WeightReceiver:
    """Weight-update groups and loaders for one embedded engine."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine
        self.weights = engine.runner.weight_map
        self.checker = WeightsChecker(self.weights)
        self.loader = BucketLoader(self.weights)
        """Flattened buckets' copy plans, kept from sync to sync (used on the engine thread)."""
        self.programs = Programs()
        self.groups: dict[str, dist.ProcessGroup] = {}

    def _on_engine(self, fn: Any) -> Any:
        return self.engine.call(fn).result()

    def _unknown(self, names: Sequence[str]) -> list[str]:
        return [name for name in names if not self.weights.knows(name)]

    def _apply(self, named: list[tuple[str, torch.Tensor]], weight_version: str | None,
               abort_all: bool = False) -> Outcome:
        """Load tensors on the engine thread and stamp the new weight version."""
        unknown = self._unknown([n for n, _ in named])
        if unknown:
            return False, (f"{len(unknown)} unknown weight names, e.g. {unknown[:3]}; the model "
                           f"has e.g. {self.weights.checkpoint_names()[:3]}")
        return self._update(lambda: functools.partial(self.weights.load_many, named),
                            weight_version, abort_all)

    def _apply_buckets(self, parts: Sequence[tuple[BucketRecords, dict[str, Any]]],
                       weight_version: str | None, abort_all: bool = False,
                       kept: Sequence[KeptPart] = (),
                       made: list[KeptPart] | None = None) -> Outcome:
        """Load ``flattened_bucket`` payloads (their records read already) through the
        :class:`BucketLoader` in one engine-thread call, every record checked before requests
        are aborted or anything is written; ``kept`` parts (planned already) first, all their
        copies in one ``torch._foreach_copy_``. ``made``: gets the first payload as a
        :class:`KeptPart` once it loaded (its plan and sources made on the engine thread)."""
        def prepare() -> Callable[[], int]:
            plans = [self.loader.plan(records) for records, _ in parts]

            @torch.no_grad()
            def write() -> int:
                dsts: list[torch.Tensor] = []
                srcs: list[torch.Tensor] = []
                count = 0
                for part in kept:
                    found = self.loader.destinations(part.plan)
                    if found is None:  # a parameter changed: one tensor at a time
                        count += self.weights.load_many(unflatten(part.payload))
                        continue
                    dsts += found
                    srcs += part.sources
                    self.weights.mark_written(part.plan.names)
                    count += len(part.plan.names)
                if dsts:
                    torch._foreach_copy_(dsts, srcs)
                count += sum(self.loader.load(records, payload, plan)
                             for (records, payload), plan in zip(parts, plans))
                if made is not None and parts:
                    payload = parts[0][1]
                    made.append(KeptPart(payload, plans[0],
                                         self.loader.sources(plans[0], payload)))
                return count
            return write

        return self._update(prepare, weight_version, abort_all)

    def _apply_bucket(self, records: BucketRecords, payload: dict[str, Any],
                      weight_version: str | None, abort_all: bool = False) -> Outcome:
        """Load one ``flattened_bucket`` payload (see :meth:`_apply_buckets`)."""
        return self._apply_buckets([(records, payload)], weight_version, abort_all)

    def _update(self, prepare: Callable[[], Callable[[], int]], weight_version: str | None,
                abort_all: bool) -> Outcome:
        """On the engine thread: ``prepare()`` returns the write (or raises ``ValueError``),
        requests are aborted if asked, the write runs and the new weight version is stamped."""
        def load() -> int:
            write = prepare()
            if abort_all:
                self.engine.abort_requests(None, "aborted for a weight update")
            count = write()
            if weight_version is not None:
                self.engine.weight_version = str(weight_version)
            return count

        try:
            count = self._on_engine(load)
        except ValueError as err:
            return False, str(err)
        return True, f"updated {count} tensors; weight_version={self.engine.weight_version}"

    def init_group(self, master_address: str, master_port: int, rank_offset: int,
                   world_size: int, group_name: str, backend: str) -> Outcome:
        """Join the sender's group as rank ``rank_offset`` (this engine has one rank)."""
        if group_name in self.groups:
            return False, (f"group_name {group_name!r} already exists; destroy it first or use "
                           "another name")
        if self.engine.runner.device.type == "cpu":
            backend = "gloo"
        try:
            group = open_weight_update_group(master_address, int(master_port), int(rank_offset),
                                             int(world_size), group_name, backend)
        except RuntimeError as err:  # rendezvous timeout, refused connection, bad world size
            return False, (f"could not join {group_name} at {master_address}:{master_port} as "
                           f"rank {rank_offset} of {world_size}: {err}; check that the sender "
                           "(rank 0) joins at the same time with the same address and size")
        self.groups[group_name] = group
        return True, f"joined {group_name} as rank {rank_offset} of {world_size} ({backend})"

    def destroy_group(self, group_name: str) -> Outcome:
        """Leave and destroy a weight-update group."""
        group = self.groups.pop(group_name, None)
        if group is None:
            return False, f"group_name {group_name!r} does not exist"
        close_weight_update_group(group)
        return True, f"destroyed {group_name}"

    def receive(self, names: Sequence[str], dtypes: Sequence[str],
                shapes: Sequence[Sequence[int]], group_name: str,
                weight_version: str | None, abort_all: bool,
                load_format: str | None = None) -> Outcome:
        """Receive one broadcast bucket (sender = rank 0), then load it: one broadcast per
        tensor, or with ``load_format="flattened_bucket"`` one uint8 broadcast of the tensors'
        bytes back to back (SGLang's ``_update_bucketed_weights_from_distributed``)."""
        if not len(names) == len(dtypes) == len(shapes):
            return False, (f"names, dtypes and shapes must have equal lengths (got {len(names)}, "
                           f"{len(dtypes)}, {len(shapes)})")
        if load_format not in (None, FLATTENED_BUCKET):
            return False, (f"load_format {load_format!r} is not supported by "
                           f"update_weights_from_distributed; use null or {FLATTENED_BUCKET}")
        group = self.groups.get(group_name)
        if group is None:
            return False, (f"group_name {group_name!r} does not exist; call "
                           "/init_weights_update_group first")
        device = self.engine.runner.device
        torch_dtypes = [parse_dtype(d) for d in dtypes]
        if load_format == FLATTENED_BUCKET:
            metadata = bucket_metadata(list(zip(names, shapes, torch_dtypes)))
            flat = torch.empty(metadata[-1].end_idx if metadata else 0, dtype=torch.uint8,
                               device=device)
            try:
                dist.broadcast(flat, src=0, group=group)
            except RuntimeError as err:
                return False, f"broadcast of a {flat.numel()}-byte bucket failed: {err}"
            return self._apply_bucket(bucket_records(metadata),
                                      {"flattened_tensor": flat, "metadata": metadata},
                                      weight_version, abort_all)
        received = []
        try:
            for name, dtype, shape in zip(names, torch_dtypes, shapes):
                tensor = torch.empty(tuple(shape), dtype=dtype, device=device)
                dist.broadcast(tensor, src=0, group=group)
                received.append((name, tensor))
        except RuntimeError as err:  # the sender died or timed out mid-bucket
            return False, (f"broadcast of {name} in {group_name} failed after "
                           f"{len(received)} of {len(names)} tensors: {err}")
        return self._apply(received, weight_version, abort_all)

    def from_serialized(self, serialized: Sequence[str], load_format: str | None,
                        weight_version: str | None, abort_all: bool,
                        keep: Any = None, replay: Any = None) -> Outcome:
        """Load what SGLang's ``/update_weights_from_tensor`` carries: one serialized entry per
        engine TP rank (this engine is TP rank 0: entry 0), read through the allow-list; a
        ``flattened_bucket`` payload or a list of (name, tensor). CUDA tensors are the sender's
        memory opened through CUDA IPC and copied straight into the weights. megarl's own
        fields (:class:`Programs`): ``keep`` keeps the payload's views as a program part,
        ``replay`` copies a kept program in again first (then ``serialized`` may be empty)."""
        if not serialized and replay is None:
            return False, "serialized_named_tensors: empty; give one entry per engine TP rank"
        if load_format not in (None, "direct", FLATTENED_BUCKET):
            return False, (f"load_format {load_format!r} is not supported; use null, direct or "
                           f"{FLATTENED_BUCKET}")
        if (keep is not None or replay is not None) and load_format != FLATTENED_BUCKET:
            return False, f"megarl_keep and megarl_replay need load_format {FLATTENED_BUCKET}"
        try:
            payload = deserialize(serialized[0]) if serialized else None
            if load_format == FLATTENED_BUCKET and payload is not None:
                records = bucket_records(payload["metadata"])
            elif payload is not None:
                named = [(str(n), t) for n, t in payload]
        except (ValueError, TypeError, KeyError, AttributeError, pickle.UnpicklingError,
                RuntimeError) as err:
            return False, f"serialized_named_tensors[0] could not be read: {err}"
        if load_format != FLATTENED_BUCKET:
            return self._apply(named, weight_version, abort_all)
        parts = [] if payload is None else [(records, payload)]
        kept: list[KeptPart] = []
        if replay is not None:
            held = self.programs.parts(replay)
            if held is None:
                return False, (f"megarl_replay: program {replay!r} is not held by this engine "
                               "(restarted?); send its views again with megarl_keep")
            kept = held
        if keep is not None:
            try:
                self.programs.check(keep, payload)
            except ValueError as err:
                return False, str(err)
        made: list[KeptPart] = []
        outcome = self._apply_buckets(parts, weight_version, abort_all, kept,
                                      made if keep is not None else None)
        if made and outcome[0]:
            self.programs.keep(keep, made[0])
        return outcome

    def from_disk(self, model_path: str, weight_version: str | None,
                  abort_all: bool) -> Outcome:
        """Reload every tensor of an HF directory's safetensors files."""
        try:
            named = list(iter_safetensors(model_path))
        except FileNotFoundError as err:
            return False, str(err)
        return self._apply(named, weight_version, abort_all)

    def get(self, name: str, truncate_size: int) -> list[Any]:
        """The first ``truncate_size`` rows of a weight, as float32 nested lists."""
        return self._on_engine(
            lambda: self.weights.view(name)[:truncate_size].float().cpu().tolist())

    def check(self, action: str) -> Outcome:
        """``snapshot`` | ``reset_tensors`` | ``compare``."""
        actions = {"snapshot": lambda: (True, self.checker.snapshot()),
                   "reset_tensors": lambda: (True, self.checker.reset_tensors()),
                   "compare": self.checker.compare}
        if action not in actions:
            return False, f"action {action!r} must be one of {sorted(actions)}"
        return self._on_engine(actions[action])

