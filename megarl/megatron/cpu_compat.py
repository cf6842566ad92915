"""Run megatron-core 0.16 on CPU-only torch (gloo), for development and CI.

megatron-core assumes CUDA in a handful of places. On a machine where
``torch.cuda.is_available()`` is False, :func:`enable` maps each of them to the CPU; where CUDA is
available it does nothing at all. Every touchpoint, in the order it is hit (the unbound
``te_general_gemm`` name, which breaks MoE routers without TransformerEngine on GPUs as well, is
handled by :func:`megarl.megatron.native_spec.bind_missing_te_names`; megatron's
``torch.compile``-decorated fusions run eagerly without CUDA, set up at import by
:class:`megarl.megatron.EagerFusionsWithoutCuda`):

1. ``torch.cuda.current_device()`` is called in ~60 places and its result passed as a device
   (rotary ``inv_freq.to(...)``, all-gather buffers, the router moving its weight on the first
   forward, ``GlobalMemoryBuffer``). It returns the string ``"cpu"``.
2. Hard-coded ``device="cuda"`` factories and ``.cuda()`` calls (``get_default_causal_mask``,
   ``total_num_tokens`` in the pipeline schedules, the optimizer's ``found_inf`` and
   grad-norm tensors, ``pin_memory=True``). A ``TorchFunctionMode`` rewrites cuda device
   arguments of any torch function to ``"cpu"``, makes ``Tensor.cuda()`` the identity and drops
   ``pin_memory``. Modes are thread-local: :func:`enable` pushes it on the calling thread, so the
   engine calls :func:`enable` at each entry point (cheap and idempotent).
3. The CUDA RNG tracker (``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork()``,
   checkpointed recompute) reads and writes the CUDA generator through ``torch.cuda.*rng*`` and
   the helpers ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` of
   ``megatron.core.tensor_parallel.random``. They are mapped to the CPU default generator, which
   then plays the role of the device generator (the tracker's fork still saves and restores it;
   its "CPU RNG state changed within GPU RNG context" warning is filtered out).
4. ``torch.cuda.Stream`` / ``Event`` / ``current_stream`` / ``synchronize`` (the alltoall token
   dispatcher creates a stream in ``__init__``; mbridge sets ``variable_seq_lengths=True``, which
   requires that dispatcher). They become no-op stand-ins: CPU work is already in order.
5. ``TopKRouter`` moves its weight to ``torch.cuda.current_device()`` on the first forward:
   covered by (1).
6. The alltoall dispatcher turns its split sizes into numpy arrays through
   ``moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)``, which only converts CUDA
   tensors; ``all_to_all_single`` rejects the CPU tensors it leaves. The function (also as
   imported by ``token_dispatcher``) converts CPU tensors too.
7. Type-string checks: the (distributed) optimizer accepts parameters only if
   ``param.type()`` is ``'torch.cuda.FloatTensor'`` / ``HalfTensor`` / ``BFloat16Tensor``, and
   ``clip_grad_by_total_norm_fp32`` asserts the same of gradients. Under the device mode of (2),
   ``Tensor.type()`` without arguments names a CPU tensor's CUDA type.
8. Uneven collectives: the alltoall dispatcher with expert-tensor parallelism gathers and
   reduce-scatters tokens inside the expert-TP group with per-rank split sizes that differ when
   routing is uneven (``gather_from_sequence_parallel_region(..., output_split_sizes=...)`` calls
   ``torch.distributed.all_gather`` with a list of uneven tensors, its backward and the combine
   call ``torch.distributed.reduce_scatter`` with uneven inputs). NCCL accepts that; gloo raises
   ``ProcessGroupGloo::allgather: invalid tensor size``. On gloo groups both functions pad every
   piece along dim 0 to the largest, run the equal-size collective and copy the pieces back.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_lock = threading.Lock()
_patched = False


def cuda_missing() -> bool:
    """True when this process has no usable CUDA device (the layer applies)."""
    return not torch.cuda.is_available()


def is_enabled() -> bool:
    """True once :func:`enable` has installed the process-wide patches."""
    return _patched


def enable() -> bool:
    """Install the CPU layer if CUDA is unavailable; idempotent. Returns whether it is active.

    Process-wide patches (1, 3, 4, 6, 8) are installed once; the device mode (2) is pushed on the
    calling thread if it is not on that thread's mode stack already.
    """
    global _patched
    if not cuda_missing():
        return False
    with _lock:
        if not _patched:
            _patch_current_device()
            _patch_rng()
            _patch_streams()
            _patch_split_sizes()
            _patch_uneven_collectives()
            _patched = True
    _push_device_mode()
    return True


# --- 1. current device -------------------------------------------------------------------------


def _patch_current_device() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.set_device = lambda device: None


# --- 2. device="cuda" arguments ----------------------------------------------------------------


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # a bare int means a CUDA ordinal to torch factories and Tensor.to
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of torch functions to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if name.count(".") == 1 else name
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _push_device_mode() -> None:
    from torch.overrides import _get_current_function_mode_stack

    if not any(isinstance(m, _CudaToCpuMode) for m in _get_current_function_mode_stack()):
        _CudaToCpuMode().__enter__()


# --- 3. RNG ------------------------------------------------------------------------------------


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


class _SameGeneratorFilter(logging.Filter):
    """Drops megatron's 'CPU RNG state changed within GPU RNG context' warning: with the CPU
    generator standing in for the CUDA one, every draw inside a tracker fork changes it (the
    fork still restores it on exit)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Keep every record but that warning."""
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    logging.getLogger(mcore_random.__name__).addFilter(_SameGeneratorFilter())

    mcore_random._get_cuda_rng_state = _cpu_get_rng_state
    mcore_random._set_cuda_rng_state = _cpu_set_rng_state
    for module in (torch.cuda, torch.cuda.random):
        module.get_rng_state = lambda device="cuda": torch.get_rng_state()
        module.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
        module.get_rng_state_all = lambda: [torch.get_rng_state()]
        module.set_rng_state_all = lambda states: torch.set_rng_state(states[0])
        # the CPU generator itself: torch.manual_seed calls torch.cuda.manual_seed_all
        module.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
        module.manual_seed_all = lambda seed: torch.default_generator.manual_seed(int(seed))


# --- 4. streams and events ---------------------------------------------------------------------


class NullStream:
    """Stand-in for ``torch.cuda.Stream`` on the CPU: every operation is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device("cpu")

    def wait_stream(self, stream: Any) -> None:
        """No-op."""

    def wait_event(self, event: Any) -> None:
        """No-op."""

    def record_event(self, event: Any = None) -> NullEvent:
        """Return a completed event."""
        return event if event is not None else NullEvent()

    def synchronize(self) -> None:
        """No-op."""

    def query(self) -> bool:
        """Always complete."""
        return True


class NullEvent:
    """Stand-in for ``torch.cuda.Event`` on the CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        """No-op."""

    def wait(self, stream: Any = None) -> None:
        """No-op."""

    def synchronize(self) -> None:
        """No-op."""

    def query(self) -> bool:
        """Always complete."""
        return True

    def elapsed_time(self, end_event: Any) -> float:
        """CPU events carry no timing."""
        return 0.0


_NULL_STREAM = NullStream()


def _patch_streams() -> None:
    torch.cuda.Stream = NullStream
    torch.cuda.Event = NullEvent
    torch.cuda.current_stream = lambda device=None: _NULL_STREAM
    torch.cuda.default_stream = lambda device=None: _NULL_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None


# --- 6. all-to-all split sizes -----------------------------------------------------------------


def _cpu_tensor_to_numpy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor


def _patch_split_sizes() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    moe_utils.maybe_move_tensor_to_cpu = _cpu_tensor_to_numpy
    token_dispatcher.maybe_move_tensor_to_cpu = _cpu_tensor_to_numpy


# --- 8. uneven all_gather / reduce_scatter on gloo ---------------------------------------------


def _is_uneven_on_gloo(tensors: list[torch.Tensor], group: Any, async_op: bool) -> bool:
    """True when the pieces differ only in dim 0 and the group's backend is gloo (sync call)."""
    import torch.distributed as dist

    if async_op or not tensors or len({t.shape for t in tensors}) == 1:
        return False
    if len({(t.shape[1:], t.dtype) for t in tensors}) != 1:
        return False  # not a split along dim 0: leave it to torch
    return dist.get_backend(group) == "gloo"


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows appended up to ``rows`` rows (contiguous)."""
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    return padded


def _make_uneven_all_gather(original: Any) -> Any:
    """Wrap ``torch.distributed.all_gather`` so that gloo gathers pieces of unequal dim 0."""

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if not _is_uneven_on_gloo(list(tensor_list), group, async_op):
            return original(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        gathered = [tensor.new_empty((rows, *tensor.shape[1:])) for _ in tensor_list]
        original(gathered, _pad_rows(tensor, rows), group=group)
        for out, full in zip(tensor_list, gathered):
            out.copy_(full[: out.shape[0]])
        return None

    all_gather._megarl_uneven = True
    return all_gather


def _make_uneven_reduce_scatter(original: Any) -> Any:
    """Wrap ``torch.distributed.reduce_scatter`` so that gloo reduces inputs of unequal dim 0."""
    import torch.distributed as dist

    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not _is_uneven_on_gloo(list(input_list), group, async_op):
            return original(output, input_list, op=op, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in input_list)
        padded_out = output.new_empty((rows, *output.shape[1:]))
        padded_in = [_pad_rows(t, rows) for t in input_list]
        original(padded_out, padded_in, op=op, group=group)
        output.copy_(padded_out[: output.shape[0]])
        return None

    reduce_scatter._megarl_uneven = True
    return reduce_scatter


def _patch_uneven_collectives() -> None:
    import torch.distributed as dist

    if not getattr(dist.all_gather, "_megarl_uneven", False):
        dist.all_gather = _make_uneven_all_gather(dist.all_gather)
    if not getattr(dist.reduce_scatter, "_megarl_uneven", False):
        dist.reduce_scatter = _make_uneven_reduce_scatter(dist.reduce_scatter)
