"""The checkpoint engine: weights from the train pool to every rollout engine.

- :mod:`~megarl.weights.buckets`: plans and packs (name, tensor) streams into byte buckets.
- :mod:`~megarl.weights.receiver`: what an engine offers to receive weights (check/apply/checksums).
- :mod:`~megarl.weights.transports`: ``nccl`` (gloo on CPU), ``nixl``, ``ipc``, ``disk``.
- :mod:`~megarl.weights.update`: the protocol of one update (:class:`WeightSender`,
  :class:`WeightUpdateEndpoint`).
- :mod:`~megarl.weights.checksums`: per-tensor hashes both sides compute the same way.
- :mod:`~megarl.weights.export`: the Megatron model's HF-named tensor stream
  (:class:`MegatronExporter`, :func:`sync_weights`).
- :mod:`~megarl.weights.links`: control links to the engines (:class:`~megarl.weights.links.
  HttpLink` for engine servers, :class:`~megarl.weights.links.PipeLink` for child processes).
"""

from megarl.weights.buckets import (
    Bucket,
    BucketMeta,
    BucketPlan,
    BufferPool,
    TensorMeta,
    TensorSpec,
    dtype_name,
    pack,
    parse_dtype,
    specs_of,
    unpack,
)
from megarl.weights.checksums import checksums, tensor_checksum, verify
from megarl.weights.export import MegatronExporter, sync_weights
from megarl.weights.receiver import StateDictReceiver, WeightMismatch, WeightReceiver
from megarl.weights.update import (
    EngineLink,
    UpdateRejected,
    UpdateReport,
    WeightSender,
    WeightUpdateEndpoint,
)

__all__ = [
    "Bucket", "BucketMeta", "BucketPlan", "BufferPool", "EngineLink", "MegatronExporter",
    "StateDictReceiver", "TensorMeta", "TensorSpec", "UpdateRejected", "UpdateReport",
    "WeightMismatch", "WeightReceiver", "WeightSender", "WeightUpdateEndpoint", "checksums",
    "dtype_name", "pack", "parse_dtype", "specs_of", "sync_weights", "tensor_checksum", "unpack",
    "verify",
]
