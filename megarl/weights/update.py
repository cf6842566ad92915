"""The protocol of one weight update, sender and engine sides, over any transport.

Control messages are JSON-ready dicts with an ``op``; every engine answers each with
``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``. One update is::

    begin  {plan, version}          every engine checks every bucket's names/shapes/dtypes
    bucket {meta, <transport>} x N  (per-bucket transports) the bytes follow by the transport
    load   {<transport>}            (disk) the whole update at once
    end    {version, checksums}     the engine takes the new version; optional checksums

``connect {transport, <transport>}`` precedes the first update and ``close`` ends a transport.
If any engine rejects ``begin`` nothing has been sent and every engine keeps its old weights;
the sender raises :class:`UpdateRejected` naming the engine and the tensor. A failure after
``begin`` (transport error, timeout) sends ``abort``; the update is then incomplete and the
engines keep their old ``weight_version``.

Memory on the sender: the caller's iterator is consumed on the calling thread, which packs
bucket k+1 while a shipping thread posts, pushes and waits for the engines on bucket k; a
:class:`~megarl.weights.buckets.BufferPool` of two slots bounds what exists at once to two
bucket buffers (one larger when a single tensor exceeds the bucket size).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from megarl.weights.buckets import (
    Bucket,
    BucketMeta,
    BucketPlan,
    BufferPool,
    PoolClosed,
    TensorSpec,
    pack,
    specs_of,
)
from megarl.weights.checksums import checksums, verify
from megarl.weights.receiver import WeightReceiver
from megarl.weights.transports import Message, ReceiverTransport, SenderTransport, open_receiver

Replies = Callable[[], list[dict[str, Any]]]


class EngineLink(Protocol):
    """The control path from the sender to every engine (HTTP, pipes, Ray...)."""

    def __len__(self) -> int:
        """Number of engines."""
        ...

    def post(self, messages: Sequence[Message]) -> Replies:
        """Send ``messages[i]`` to engine ``i`` without waiting; the result waits for the
        replies (one per engine, in engine order)."""
        ...


class UpdateRejected(RuntimeError):
    """One or more engines answered a control message with ``ok: false``."""


@dataclass
class UpdateReport:
    """What one weight update did."""

    version: str
    num_tensors: int
    num_buckets: int
    bytes: int
    """Tensor bytes sent to each engine."""
    seconds: float
    peak_buffer_bytes: int
    """The most bucket-buffer bytes the sender held at once."""
    mismatches: dict[int, list[str]] | None = None
    """Per engine, the tensors whose checksums differ (None: checksums were not requested)."""
    sender_checksums: dict[str, str] = field(default_factory=dict)

    @property
    def gb_per_s(self) -> float:
        """Tensor bytes per engine / seconds, in GB/s."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def _check_replies(replies: list[dict[str, Any]], op: str) -> list[dict[str, Any]]:
    failed = [f"engine {i}: {r.get('error', 'no error message')}"
              for i, r in enumerate(replies) if not r.get("ok")]
    if failed:
        raise UpdateRejected(f"{op} failed on {len(failed)} of {len(replies)} engines: "
                             + "; ".join(failed))
    return replies


class WeightSender:
    """Sends weight updates to every engine over one transport; lives across updates."""

    def __init__(self, transport: SenderTransport, link: EngineLink, *,
                 bucket_size_mb: float, dtype: torch.dtype | None = None,
                 split_on_dtype: bool = False) -> None:
        self.transport = transport
        self.link = link
        self.bucket_bytes = int(bucket_size_mb * (1 << 20))
        self.dtype = dtype
        self.split_on_dtype = split_on_dtype
        self._plan: BucketPlan | None = None
        self._pool: BufferPool | None = None

    def _call(self, op: str, fields: Message | Sequence[Message]) -> list[dict[str, Any]]:
        messages = ([{"op": op, **fields}] * len(self.link) if isinstance(fields, Mapping)
                    else [{"op": op, **f} for f in fields])
        return _check_replies(self.link.post(messages)(), op)

    def connect(self) -> None:
        """Connect every engine to the transport (for ``nccl``: form the process group)."""
        requests = self.transport.connect_requests(len(self.link))
        replies = self.link.post([{"op": "connect", "transport": self.transport.kind, **r}
                                  for r in requests])
        self.transport.join()
        _check_replies(replies(), "connect")

    def plan(self, specs: Iterable[TensorSpec]) -> BucketPlan:
        """Lay out an update of these tensors with this sender's bucket size and dtype."""
        return BucketPlan.from_specs(specs, self.bucket_bytes, self.dtype, self.split_on_dtype)

    def update(self, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
               version: str, specs: Iterable[TensorSpec] | None = None,
               verify_checksums: bool = False) -> UpdateReport:
        """Send one update; every engine holds exactly these tensors afterwards, or none of them
        when an engine rejects the plan (:class:`UpdateRejected`).

        The plan comes from ``specs``, else from ``named`` when it is a mapping, else the
        previous update's plan is reused (the exporter must then yield the same tensors).
        """
        if specs is not None:
            plan = self.plan(specs)
        elif isinstance(named, Mapping):
            plan = self.plan(specs_of(named))
        elif self._plan is not None:
            plan = self._plan
        else:
            raise ValueError("the first update from an iterator needs specs=[TensorSpec(name, "
                             "shape, dtype), ...] (or pass a mapping) so that engines can check "
                             "the whole update before any weight is overwritten")
        items = iter(named.items() if isinstance(named, Mapping) else named)
        sent: dict[str, str] | None = {} if verify_checksums else None
        start = time.perf_counter()
        try:
            self._call("begin", {"plan": plan.to_json(), "version": version})
            pool = self._stream(plan, items, sent)
            final = self.transport.finish(plan, version)
            if final is not None:
                self._call("load", final)
            replies = self._call("end", {"version": version, "checksums": verify_checksums})
        except BaseException as err:
            self._abort(err)
            raise
        self._plan = plan
        report = UpdateReport(version, plan.num_tensors, len(plan.buckets), plan.total_bytes,
                              time.perf_counter() - start, pool.peak_bytes)
        if sent is not None:
            report.sender_checksums = sent
            report.mismatches = {i: verify(sent, r.get("checksums") or {})
                                 for i, r in enumerate(replies)}
        return report

    def _pool_for(self, plan: BucketPlan) -> BufferPool:
        size = max((b.nbytes for b in plan.buckets if b.nbytes <= self.bucket_bytes), default=1)
        if self._pool is None or self._pool.size != size:
            if self._pool is not None:
                self._pool.close()
            self._pool = BufferPool(self.transport.allocate, self.transport.free, max(size, 1))
        self._pool.peak_bytes = self._pool.live_bytes
        return self._pool

    def _stream(self, plan: BucketPlan, items: Iterator[tuple[str, torch.Tensor]],
                sent: dict[str, str] | None) -> BufferPool:
        """Pack on this thread, ship on another; returns the pool (for its peak)."""
        pool = self._pool_for(plan)
        inbox: queue.Queue[Bucket | None] = queue.Queue()
        failures: list[BaseException] = []
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        shipper = threading.Thread(target=self._ship, name="megarl-weight-ship", daemon=True,
                                   args=(inbox, pool, sent, failures, device))
        # The shipper stops at the first failure on either thread: buckets packed before a
        # packing error are not sent (the update is aborted anyway).
        shipper.start()
        try:
            for meta in plan.buckets:
                inbox.put(pack(pool.acquire(meta.nbytes), meta, items))
            extra = next(items, None)
            if extra is not None:
                raise ValueError(f"the exporter yielded {extra[0]} after the last planned "
                                 "tensor; rebuild the plan from the current specs")
        except PoolClosed:
            pass
        except Exception as err:  # noqa: BLE001 - re-raised below, after the shipper stopped
            failures.append(err)
        finally:
            inbox.put(None)
            shipper.join()
        if failures:
            pool.reset()
            raise failures[0]
        return pool

    def _ship(self, inbox: queue.Queue[Bucket | None], pool: BufferPool,
              sent: dict[str, str] | None, failures: list[BaseException],
              device: int | None) -> None:
        if device is not None:
            torch.cuda.set_device(device)
        try:
            while (bucket := inbox.get()) is not None:
                if failures:
                    continue
                request = self.transport.bucket_request(bucket)
                replies = None
                if request is not None:
                    message = {"op": "bucket", "meta": bucket.meta.to_json(), **request}
                    replies = self.link.post([message] * len(self.link))
                self.transport.push(bucket)
                if sent is not None:
                    sent.update(checksums(bucket.named_tensors()))
                if replies is not None:
                    _check_replies(replies(), f"bucket {bucket.meta.index}")
                pool.release(bucket.buffer)
        except Exception as err:  # noqa: BLE001 - handed to the packing thread, which raises it
            failures.append(err)
            pool.abort(err)

    def _abort(self, err: BaseException) -> None:
        try:
            self.link.post([{"op": "abort", "reason": str(err)}] * len(self.link))()
        except Exception as abort_err:  # noqa: BLE001 - the original error is what matters
            err.add_note(f"telling the engines to abort also failed: {abort_err}")

    def close(self) -> None:
        """Close the transport on every engine and here; free bucket memory."""
        try:
            self._call("close", {})
        finally:
            if self._pool is not None:
                self._pool.close()
            self.transport.close()


class WeightUpdateEndpoint:
    """The engine's half of the protocol: one control message in, one reply out."""

    def __init__(self, receiver: WeightReceiver, device: torch.device | str = "cpu") -> None:
        self.receiver = receiver
        self.device = torch.device(device)
        self.transport: ReceiverTransport | None = None
        self.weight_version: str | None = None
        self._plan: BucketPlan | None = None
        self._received = 0
        self._handlers: dict[str, Callable[[Message], dict[str, Any] | None]] = {
            "connect": self._connect, "begin": self._begin, "bucket": self._bucket,
            "load": self._load, "end": self._end, "abort": self._abort, "close": self._close,
        }

    def handle(self, message: Message) -> dict[str, Any]:
        """Run one control message; errors come back as ``{"ok": False, "error": ...}``."""
        handler = self._handlers.get(message.get("op", ""))
        if handler is None:
            return {"ok": False, "error": f"op {message.get('op')!r} is not known; use one of "
                                          f"{sorted(self._handlers)}"}
        try:
            return {"ok": True, **(handler(message) or {})}
        except Exception as err:  # noqa: BLE001 - the reply carries it to the sender
            return {"ok": False, "error": f"{type(err).__name__}: {err}"}

    def _require_transport(self) -> ReceiverTransport:
        if self.transport is None:
            raise RuntimeError("no transport is connected; the sender must send 'connect' first")
        return self.transport

    def _require_plan(self) -> BucketPlan:
        if self._plan is None:
            raise RuntimeError("no update in progress; the sender must send 'begin' first")
        return self._plan

    def _connect(self, message: Message) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self.transport = open_receiver(str(message["transport"]), message, self.device)

    def _begin(self, message: Message) -> None:
        self._plan = None
        plan = BucketPlan.from_json(message["plan"])
        for meta in plan.buckets:
            self.receiver.check(meta)
        self._plan, self._received = plan, 0

    def _bucket(self, message: Message) -> None:
        transport = self._require_transport()
        meta = BucketMeta.from_json(message["meta"])
        named = transport.receive(meta, message)
        try:
            plan = self._require_plan()
            expected = plan.buckets[self._received] if self._received < len(plan.buckets) else None
            if meta != expected:
                self._plan = None
                raise RuntimeError(f"bucket {meta.index} arrived, the plan expects "
                                   f"{'no more buckets' if expected is None else expected.index}"
                                   " with the announced layout; the update is abandoned")
            self.receiver.apply(named)
            self._received += 1
        finally:
            transport.release()

    def _load(self, message: Message) -> None:
        plan = self._require_plan()
        for named in self._require_transport().load(plan, message):
            self.receiver.apply(named)
            self._received += 1

    def _end(self, message: Message) -> dict[str, Any]:
        plan = self._require_plan()
        self._plan = None
        if self._received != len(plan.buckets):
            raise RuntimeError(f"update {message.get('version')} is incomplete: "
                               f"{self._received} of {len(plan.buckets)} buckets arrived")
        self.weight_version = str(message["version"])
        if not message.get("checksums"):
            return {"weight_version": self.weight_version}
        names = [t.name for b in plan.buckets for t in b.tensors]
        return {"weight_version": self.weight_version,
                "checksums": self.receiver.checksums(names)}

    def _abort(self, message: Message) -> None:
        self._plan = None

    def _close(self, message: Message) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
