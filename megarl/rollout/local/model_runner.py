"""The embedded engine's model: an HF causal LM, a batched KV cache, MoE routes.

Two decode backends share one interface (``prefill`` -> ``append_rows`` / ``keep_rows`` /
``clear_rows`` -> ``decode``): ``native`` (:mod:`megarl.rollout.local.static_kv`: a static KV
cache, FlashAttention decode and CUDA graphs; the default on CUDA for the model families it
knows) and ``hf``, the HF forward over a left-padded ``DynamicCache`` described below (the
default on the CPU, and for other models).

In the ``hf`` backend rows of the running batch share one KV cache tensor per layer,
``[rows, kv_heads, T, head_dim]``,
left-padded: row i's real tokens are the last ``lengths[i]`` columns and the attention mask
hides the padding. Rows join (after their prefill) by padding both sides to a common length and
concatenating; finished rows are dropped and columns that became padding for every row are cut.
Positions are passed explicitly per row so padding never shifts the rotary embedding.

Routed experts are read by forward hooks on the MoE router modules (the classes transformers
records as ``router_logits``), which return ``(logits, weights, expert indices)``: the indices
actually used by the forward are recorded, one ``[tokens, top_k]`` tensor per MoE layer.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from megarl.rollout.local.fp8_layers import (
    Fp8Experts,
    experts_backend,
    fused_experts_available,
    quantize_model,
)
from megarl.rollout.local.lora_serving import LoraServing
from megarl.rollout.local.sampling import FusedSampling
from megarl.rollout.local.static_kv import NativeDecoder, PrefillKV, native_unsupported_reason
from megarl.rollout.local.weights import WeightMap

logger = logging.getLogger(__name__)
Backend = Literal["auto", "hf", "native"]
LOAD_FORMATS = ("auto", "dummy")
"""SGLang's ``--load-format`` values the engine takes: ``auto`` reads the checkpoint's
safetensors; ``dummy`` builds the model from its config.json alone (random weights, no read of
the checkpoint) and refuses ``/generate`` until a weight update has written every tensor
(``rollout.load_format``: the trainer syncs first)."""


def _router_class(model: nn.Module) -> type[nn.Module] | None:
    """The module class whose output carries router logits (None for dense models)."""
    recorder = getattr(model, "_can_record_outputs", None) or {}
    target = recorder.get("router_logits")
    if target is None:
        return None
    return getattr(target, "target_class", target)


class RouterCapture:
    """Forward hooks that record the experts chosen for every token while enabled."""

    def __init__(self, model: nn.Module, top_k: int) -> None:
        router_cls = _router_class(model)
        self.routers = [m for m in model.modules()
                        if router_cls is not None and isinstance(m, router_cls)]
        self.top_k = top_k
        self.enabled = False
        self._records: list[torch.Tensor] = []
        for module in self.routers:
            module.register_forward_hook(self._hook)

    @property
    def num_layers(self) -> int:
        """Number of MoE layers (0 for a dense model)."""
        return len(self.routers)

    def _hook(self, module: nn.Module, args: object, output: object) -> None:
        if not self.enabled:
            return
        if isinstance(output, tuple) and len(output) >= 3:
            indices = output[2]
        else:
            logits = output[0] if isinstance(output, tuple) else output
            indices = logits.topk(self.top_k, dim=-1).indices
        self._records.append(indices.reshape(-1, indices.shape[-1]).to("cpu", torch.int32))

    def take(self, batch: int, seq: int) -> torch.Tensor:
        """The recorded routes as ``[batch, seq, layers, top_k]`` int32; clears the record."""
        records, self._records = self._records, []
        if len(records) != self.num_layers:
            raise RuntimeError(f"expected routes from {self.num_layers} MoE layers, got "
                               f"{len(records)}")
        return torch.stack(records, dim=1).view(batch, seq, self.num_layers, -1)


@dataclass
class KVBatch:
    """Left-padded KV cache of a set of rows plus their attention mask and lengths."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    mask: torch.Tensor
    """``[rows, T]`` long, 1 where a real token is cached."""
    lengths: torch.Tensor
    """``[rows]`` long: real tokens cached per row (= the next token's position)."""

    @property
    def rows(self) -> int:
        """Number of rows."""
        return int(self.mask.shape[0])

    def select(self, index: list[int]) -> KVBatch:
        """Keep (and possibly repeat) rows by index; cut columns that are padding for all."""
        idx = torch.tensor(index, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, idx)
        start = int(self.mask.shape[1] - mask.sum(dim=1).max()) if index else 0
        start = max(0, min(start, mask.shape[1]))
        return KVBatch(
            keys=[k.index_select(0, idx)[:, :, start:] for k in self.keys],
            values=[v.index_select(0, idx)[:, :, start:] for v in self.values],
            mask=mask[:, start:], lengths=self.lengths.index_select(0, idx.to("cpu")),
        )

    def concat(self, other: KVBatch) -> KVBatch:
        """Rows of ``self`` followed by rows of ``other``, left-padded to a common length."""
        width = max(self.mask.shape[1], other.mask.shape[1])

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - t.shape[dim]
            if missing == 0:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        return KVBatch(
            keys=[torch.cat([pad(a, 2), pad(b, 2)]) for a, b in zip(self.keys, other.keys)],
            values=[torch.cat([pad(a, 2), pad(b, 2)]) for a, b in zip(self.values, other.values)],
            mask=torch.cat([pad(self.mask, 1), pad(other.mask, 1)]),
            lengths=torch.cat([self.lengths, other.lengths]),
        )


@dataclass
class ForwardOut:
    """Last-position logits ``[rows, V]`` and, when recorded, routes ``[rows, seq, L, K]``;
    ``sampled``: the (tokens, log-probs) a decode step drew itself (fused sampler)."""

    logits: torch.Tensor
    routes: torch.Tensor | None
    sampled: tuple[list[int], list[float]] | None = None


class ModelRunner:
    """Loads an HF causal LM and runs prefill / decode forwards on batches of rows."""

    def __init__(self, model_path: str | Path, device: str = "cpu", dtype: str = "auto",
                 context_length: int | None = None, backend: Backend = "auto",
                 cuda_graphs: bool = True, trust_remote_code: bool = False,
                 quantization: str | None = None, enable_lora: bool = False,
                 weights_cpu_backup: bool = True, load_format: str = "auto",
                 fp8_ignored: tuple[str, ...] = ()) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.model_path = str(model_path)
        self.device = torch.device(device)
        config = AutoConfig.from_pretrained(self.model_path, trust_remote_code=trust_remote_code)
        self.dtype = _resolve_dtype(dtype, config, self.device)
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={load_format!r}: choose one of {LOAD_FORMATS}")
        if load_format == "dummy":  # built on the device, random; the first weight update fills it
            with torch.device(self.device):
                self.model = AutoModelForCausalLM.from_config(
                    config, dtype=self.dtype, trust_remote_code=trust_remote_code)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                self.model_path, dtype=self.dtype, trust_remote_code=trust_remote_code)
        self.model.to(self.device).eval()
        if quantization not in (None, "fp8"):
            raise ValueError(f"quantization={quantization!r}: the embedded engine runs fp8 or "
                             "none (null)")
        self.quantization = quantization
        if fp8_ignored and quantization != "fp8":
            raise ValueError(f"fp8_ignored={fp8_ignored}: only with quantization=fp8")
        if quantization == "fp8":  # block-FP8 projections, computed w8a8 (fp8_layers)
            quantize_model(self.model, ignored=fp8_ignored)
        self.lora = LoraServing(self.model) if enable_lora else None
        """The LoRA adapters served (``--enable-lora``; lora_serving.py), or None."""
        self.config = self.model.config
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.context_length = int(context_length or getattr(
            self.config, "max_position_embeddings", 4096))
        self.eos_token_ids = _eos_ids(self.model)
        self.top_k = int(getattr(self.config, "num_experts_per_tok", 0) or 0)
        self.router = RouterCapture(self.model, self.top_k)
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.cache: object | None = None
        self.batch: KVBatch | None = None
        self.native = self._make_native(backend, cuda_graphs)
        self._weight_map: WeightMap | None = None
        self.weights_cpu_backup = weights_cpu_backup
        """What :meth:`offload` does by default: keep the weights in host memory, or drop them."""
        self._dropped: list[tuple[nn.Parameter, torch.Size]] = []
        if load_format == "dummy":  # /generate is refused until a weight update wrote them all
            self.weight_map.drop(self.model.parameters(), reason=(
                "the engine started with --load-format dummy (random weights)"))

    def _make_native(self, backend: Backend, cuda_graphs: bool) -> NativeDecoder | None:
        if backend not in ("auto", "hf", "native"):
            raise ValueError(f"backend={backend!r}: choose 'auto', 'hf' or 'native'")
        reason = native_unsupported_reason(self.model)
        if reason is None and self.device.type == "cuda" and any(
                isinstance(m, Fp8Experts) for m in self.model.modules()) and \
                not fused_experts_available(self.device):
            reason = f"FP8 experts on their {experts_backend(self.device)}"
        if reason is None and self.lora is not None:
            reason = "LoRA serving (--enable-lora: adapters run as hooks of the HF modules)"
        if backend == "native" and reason is not None:
            raise ValueError(f"backend='native' cannot run {self.model_path}: {reason}; use 'hf'")
        if backend == "hf" or (backend == "auto" and (self.device.type != "cuda" or reason)):
            return None
        return NativeDecoder(self.model, cuda_graphs=cuda_graphs)

    @property
    def backend(self) -> str:
        """The decode backend in use: ``native`` or ``hf``."""
        return "hf" if self.native is None else "native"

    @property
    def fused_sampling(self) -> bool:
        """Whether :meth:`decode` can draw the next tokens itself (the native path on CUDA)."""
        return self.native is not None and self.native.fused_sampling

    @property
    def rows(self) -> int:
        """Running rows."""
        if self.native is not None:
            return self.native.rows
        return 0 if self.batch is None else self.batch.rows

    @property
    def weight_map(self) -> WeightMap:
        """Checkpoint names -> live views of this model's weights (built once, on first use)."""
        if self._weight_map is None:
            self._weight_map = WeightMap(self.model)
        return self._weight_map

    def offload(self, backup: bool | None = None) -> None:
        """Give up the weights' memory. With ``backup`` (default :attr:`weights_cpu_backup`;
        SGLang's ``--enable-weights-cpu-backup``) move them to pinned host memory (GPU only; a
        CPU model stays where it is). Without, drop every parameter's storage, on any device,
        as SGLang drops a region without CPU backup: :meth:`reload` gives them zeros and a
        weight update must write them (:meth:`WeightMap.unwritten` names what it has not;
        buffers, a few small tensors a weight sync need not carry, stay). Either way each
        parameter keeps its identity (``.data`` changes), so weight views resolved by name stay
        valid, and the fused projections and CUDA graphs are rebuilt."""
        if not (self.weights_cpu_backup if backup is None else backup):
            self.release_kv_cache()
            params = list({id(p): p for p in self.model.parameters()}.values())
            self.weight_map.drop(params)
            self._dropped = [(p, p.shape) for p in params]
            for p in params:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        elif self.device.type != "cpu":
            self.release_kv_cache()
            _move_tensors(self.model, torch.device("cpu"))
            torch.cuda.empty_cache()

    def reload(self) -> None:
        """Take the weights' memory back after :meth:`offload`: dropped parameters get zeros."""
        if self._dropped:
            for p, shape in self._dropped:
                p.data = torch.zeros(shape, dtype=p.dtype, device=self.device)
            self._dropped = []
        _move_tensors(self.model, self.device)

    def weight_bytes(self) -> int:
        """Bytes of every parameter and buffer: what the weights take on the device (dropped
        ones at their shapes: what :meth:`reload` asks for)."""
        tensors = {id(t): t for t in (*self.model.parameters(), *self.model.buffers())}
        shapes = {id(p): shape for p, shape in self._dropped}
        return sum(shapes[key].numel() * t.element_size() if key in shapes else
                   t.numel() * t.element_size() for key, t in tensors.items())

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token takes over all layers."""
        if self.native is not None:
            return self.native.cache.bytes_per_token
        cfg = self.config
        heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * int(cfg.num_hidden_layers) * heads * head_dim * itemsize

    @property
    def kv_allocated_tokens(self) -> int:
        """KV token slots the native path's cache holds now (0 on the HF path)."""
        return self.native.cache.allocated_tokens if self.native is not None else 0

    def graph_stats(self) -> dict[str, float]:
        """Decode graphs captured so far and the seconds their captures took (native path)."""
        graphs = getattr(self.native, "graphs", None)
        if graphs is None:
            return {"graph_captures": 0, "graph_capture_s": 0.0}
        return {"graph_captures": graphs.captures, "graph_capture_s": graphs.capture_s}

    @property
    def kv_page_size(self) -> int:
        """Tokens of a KV page on the native path (0 on the HF path)."""
        return 0 if self.native is None else self.native.cache.page_size

    def kv_row_slots(self, length: int) -> int:
        """KV token slots a row of ``length`` tokens holds on the native path (its pages; 0 on
        the HF path, whose padded batch :meth:`peak_kv_tokens` counts by its rectangle)."""
        if self.native is None:
            return 0
        return self.native.cache.pages_for(length) * self.native.cache.page_size

    def kv_step_pages(self) -> tuple[list[int], list[bool], int] | None:
        """Native path: per running row the KV pages it holds and whether the next decode step
        gives it one more, and the pool's free pages (None on the HF path)."""
        return None if self.native is None else self.native.step_pages()

    def peak_kv_tokens(self, rows: int, length: int, slots: int, pool: int | None = None) -> int:
        """KV token slots held at the peak of running ``rows`` rows of up to ``length`` tokens
        that hold ``slots`` slots in all (:meth:`kv_row_slots` of their final lengths): exact on the
        native path (its page pool, allocated at ``pool`` slots where it must grow, with the
        copy of the live pages); on the HF path the padded ``rows x length`` batch."""
        if self.native is not None:
            return self.native.peak_kv_tokens(slots // self.native.cache.page_size, pool)
        return rows * length

    def reserve(self, rows: int, length: int, slots: int, pool: int | None = None,
                prefill_tokens: int = 0) -> None:
        """Size the KV cache for :meth:`peak_kv_tokens`' rows (native path; the HF path grows
        its batch as it decodes). ``rows``: the most rows that may run (the page table's rows: a
        table that grows drops the decode graphs, so the engine passes its row limit);
        ``prefill_tokens``: the prefill budget, whose activations the pool leaves room for."""
        if self.native is not None:
            self.native.reserve(rows, length, slots // self.native.cache.page_size, pool,
                                prefill_tokens)

    def release_kv_cache(self) -> None:
        """Drop the running rows and free the KV cache (and CUDA graphs) until the next use."""
        self.clear_rows()
        if self.native is not None:
            self.native.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: object, routes: bool) -> tuple[torch.Tensor, object, torch.Tensor | None]:
        self.router.enabled = routes and self.router.num_layers > 0
        try:
            out = self.model(input_ids=ids.to(self.device), attention_mask=mask,
                             position_ids=positions.to(self.device), use_cache=True,
                             logits_to_keep=1, **{self._cache_arg: cache})
            captured = self.router.take(*ids.shape) if self.router.enabled else None
        finally:
            self.router.enabled = False
            self.router._records = []
        new_cache = getattr(out, "cache", None) or out.past_key_values
        return out.logits[:, -1].float(), new_cache, captured

    @torch.no_grad()
    def prefill(self, contexts: list[list[int]], routes: bool
                ) -> tuple[ForwardOut, KVBatch | PrefillKV]:
        """Run the prompts as one batch; returns logits, routes (``[rows, width, L, K]``, each
        row's tokens at the end) and their KV, to hand to :meth:`append_rows`."""
        if self.native is not None:
            logits, captured, kv = self.native.prefill(contexts, routes)
            return ForwardOut(logits, captured), kv
        from transformers import DynamicCache

        width = max(len(c) for c in contexts)
        ids = torch.zeros(len(contexts), width, dtype=torch.long)
        mask = torch.zeros(len(contexts), width, dtype=torch.long)
        for i, ctx in enumerate(contexts):
            ids[i, width - len(ctx):] = torch.tensor(ctx)
            mask[i, width - len(ctx):] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        mask = mask.to(self.device)
        logits, cache, captured = self._forward(ids, mask, positions, DynamicCache(), routes)
        kv = [(layer[0], layer[1]) for layer in cache]
        batch = KVBatch(keys=[k for k, _ in kv], values=[v for _, v in kv], mask=mask,
                        lengths=torch.tensor([len(c) for c in contexts]))
        return ForwardOut(logits, captured), batch

    def append_rows(self, kv: KVBatch | PrefillKV, index: list[int]) -> None:
        """Add rows ``index`` of a prefill's KV (repeats allowed) after the running rows."""
        if not index:
            return
        if self.native is not None:  # the prefill's K/V go to each row's pages directly
            self.native.append(kv, index)
            return
        new = kv.select(index)
        self._set_batch(new if self.batch is None else self.batch.concat(new))

    def keep_rows(self, index: list[int]) -> None:
        """Keep running rows ``index`` (in that order); the others are dropped."""
        if not index:
            self.clear_rows()
        elif self.native is not None:
            self.native.keep(index)
        elif self.batch is not None:
            self._set_batch(self.batch.select(index))

    def clear_rows(self) -> None:
        """Drop every running row."""
        if self.native is not None:
            self.native.clear()
        self._set_batch(None)

    def _set_batch(self, batch: KVBatch | None) -> None:
        """Make ``batch`` the running batch (its KV becomes the decode cache)."""
        from transformers import DynamicCache

        self.batch = batch
        self.cache = None
        if batch is not None and batch.rows > 0:
            # start from empty layers and hand them the tensors, instead of copying them in
            empty = [(k[:, :, :0], v[:, :, :0]) for k, v in zip(batch.keys, batch.values)]
            self.cache = DynamicCache(ddp_cache_data=empty)
            for layer, k, v in zip(self.cache.layers, batch.keys, batch.values):
                layer.keys, layer.values = k, v

    @torch.no_grad()
    def decode(self, tokens: list[int], routes: bool,
               sampling: FusedSampling | None = None) -> ForwardOut:
        """Feed one token per running row; returns next-token logits and the fed tokens' routes;
        with ``sampling`` (and :attr:`fused_sampling`) also the next tokens, drawn in the step."""
        if self.native is not None:
            logits, captured, sampled = self.native.decode(tokens, sampling)
            if not routes or captured is None:
                return ForwardOut(logits, None, sampled)
            return ForwardOut(logits, captured.to("cpu", torch.int32)[:, None], sampled)
        batch = self.batch
        assert batch is not None and self.cache is not None and len(tokens) == batch.rows
        ones = torch.ones(batch.rows, 1, dtype=batch.mask.dtype, device=batch.mask.device)
        batch.mask = torch.cat([batch.mask, ones], dim=1)
        ids = torch.tensor(tokens, dtype=torch.long).unsqueeze(1)
        logits, self.cache, captured = self._forward(
            ids, batch.mask, batch.lengths.unsqueeze(1), self.cache, routes)
        batch.lengths = batch.lengths + 1
        layers = list(self.cache)
        batch.keys = [layer[0] for layer in layers]
        batch.values = [layer[1] for layer in layers]
        return ForwardOut(logits, captured)


def _resolve_dtype(dtype: str, config: object, device: torch.device) -> torch.dtype:
    """``auto``: the checkpoint's dtype on GPU, float32 on CPU."""
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(stored, torch.dtype):
            return stored
        dtype = str(stored or "bfloat16")
    from megarl.rollout.weight_group import parse_dtype

    return parse_dtype(dtype)


def _eos_ids(model: nn.Module) -> tuple[int, ...]:
    """EOS ids from the generation config (or the model config)."""
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


@torch.no_grad()
def _move_tensors(model: torch.nn.Module, device: torch.device) -> None:
    """Move every parameter and buffer of ``model`` to ``device`` in place (``.data``), to
    pinned host memory when ``device`` is the CPU."""
    seen: set[int] = set()
    tensors = [*model.parameters(), *model.buffers()]
    for tensor in tensors:
        if id(tensor) in seen or tensor.device == device:
            continue
        seen.add(id(tensor))
        if device.type == "cpu":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            tensor.data = host.copy_(tensor.data, non_blocking=True)
        else:
            tensor.data = tensor.data.to(device, non_blocking=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
