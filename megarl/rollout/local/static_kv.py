"""The embedded engine's native decode path: a static KV cache, batched decode and CUDA graphs.

:class:`NativeDecoder` runs an HF decoder-only model (Llama / Qwen2 / Qwen3 layouts, dense or
Qwen3-MoE style sparse blocks) with the model's own submodules (projections, q/k norms, rotary
embedding, MLP or router + experts, LM head), so weights written into the HF model in place are
used at once; only the attention and the layer loop are its own:

- the KV cache (:class:`~megarl.rollout.local.kv_cache.PagedKVCache`) is a pool of pages per
  layer and a page table: running row ``i`` owns the pages its tokens need, nothing more.
  :meth:`NativeDecoder.reserve` sizes the pool (the engine: once, for its token budget) and the
  table for the rows' final lengths; each decode step gives a row its next page when its next
  token starts one, and the pool grows (by copy) only when nothing reserved it;
- prefill runs the new prompts right-padded with causal SDPA (padding is invisible to the real
  tokens) and hands back their K/V as a :class:`PrefillKV`;
- decode writes each row's new K/V at its position's page and slot, and attends over the row's
  length with the split-K Triton kernel through the page table (decode_attention_triton.py),
  else FlashAttention's varlen kernel or an fp32 softmax (CPU, and a fallback) over the rows'
  pages gathered; on CUDA the whole decode step (all layers, the LM head, the routing records)
  is a CUDA graph per row-count bucket (decode_graphs.py).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megarl.kernels import triton_kernels
from megarl.rollout.local.decode_graphs import DecodeGraphs
from megarl.rollout.local.decode_ops import grouped_experts, grouped_experts_match
from megarl.rollout.local.fp8_layers import unquantized_activations
from megarl.rollout.local.fused_projections import FusedLayer
from megarl.rollout.local.kv_cache import PagedKVCache, activation_headroom, row_bucket
from megarl.rollout.local.sampling import FusedSampling

logger = logging.getLogger(__name__)
SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "qwen3_moe"})
POOL_HEADROOM = 0.08
"""Of the device's memory, what a KV pool growing on a GPU leaves free (decode activations,
graphs, the prefill): the pool takes at most the rest, whatever it was reserved for."""
ALL_EXPERTS_ROWS = 8192
"""Decode runs every expert on every row while rows * experts is at most this."""


@dataclass
class PrefillKV:
    """Prefill K/V not yet in the cache: per layer ``[rows, width, kv_heads, head_dim]``."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: torch.Tensor
    """``[rows]`` long (CPU): real tokens per row (the rest of ``width`` is padding)."""

    @property
    def rows(self) -> int:
        """Number of rows."""
        return int(self.lengths.shape[0])

    def select(self, index: list[int]) -> PrefillKV:
        """Keep (and possibly repeat) rows by index."""
        idx = torch.tensor(index, dtype=torch.long)
        dev = idx.to(self.keys[0].device) if self.keys else idx
        return PrefillKV([k.index_select(0, dev) for k in self.keys],
                         [v.index_select(0, dev) for v in self.values],
                         self.lengths.index_select(0, idx))


def native_unsupported_reason(model: nn.Module) -> str | None:
    """Why :class:`NativeDecoder` cannot run ``model`` (None when it can)."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {config.model_type!r} (supported: {sorted(SUPPORTED_MODEL_TYPES)})"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "no model.layers / model.rotary_emb"
    for layer in inner.layers:
        mlp = layer.mlp
        if not (hasattr(mlp, "gate_proj") or (hasattr(mlp, "gate") and hasattr(mlp, "experts"))):
            return f"unknown MLP block {type(mlp).__name__}"
        if hasattr(mlp, "shared_expert"):
            return "shared experts"
    return None


def _cuda_module(name: str):
    """``megarl.rollout.local.<name>`` (a Triton module for CUDA), or None without Triton."""
    try:
        return importlib.import_module(f"megarl.rollout.local.{name}")
    except ImportError:
        return None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``apply_rotary_pos_emb`` on ``[tokens, heads, d]`` with ``[tokens, 1, d]`` tables."""
    return (x * cos) + (_rotate_half(x) * sin)


class NativeDecoder:
    """Prefill and batched decode of an HF model over a static KV cache (see the module doc)."""

    def __init__(self, model: nn.Module, cuda_graphs: bool = True) -> None:
        reason = native_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the native decode path does not support this model: {reason}")
        self.model = model
        inner = model.model
        self.layers = list(inner.layers)
        cfg = model.config
        attn = self.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.scale = float(attn.scaling)
        self.kv_heads = int(cfg.num_key_value_heads)
        weight = inner.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.moe = any(hasattr(layer.mlp, "experts") for layer in self.layers)
        self.cache = PagedKVCache(len(self.layers), self.kv_heads, self.head_dim, self.dtype,
                                  self.device)
        self.pool_pages: int | None = None
        """Pages the pool is allocated with when it must grow (:meth:`reserve`'s ``pool``)."""
        self.activation_bytes = 0
        """What a growing pool leaves free on the device, if more than the 8% floor (set by
        :meth:`reserve`)."""
        self.lengths = torch.zeros(0, dtype=torch.long)
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        self.flash = self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16)
        self._fast_checked = False
        self._kernels = triton_kernels() if self.device.type == "cuda" else None
        self.fast_kernels = self.device.type == "cuda"
        """Triton RoPE / SwiGLU and all-experts MoE decode (CUDA; checked on first decode)."""
        self.grouped_experts = False
        """Decode above ``ALL_EXPERTS_ROWS`` through :func:`.decode_ops.grouped_experts` (probed
        with the fast kernels)."""
        self.graphs = DecodeGraphs(self)
        self._fused: list[FusedLayer] | None = None
        """Per layer, the q/k/v (and dense gate/up) weights as one tensor (CUDA; built on first
        use and again after :meth:`release`, since moving the model re-allocates weights)."""
        on_cuda = self.device.type == "cuda"
        self._decode_kernels = _cuda_module("decode_triton") if on_cuda else None
        self._split_attention = _cuda_module("decode_attention_triton") if on_cuda else None
        self.split_attention = self._split_attention is not None
        """Decode attention by the split-K Triton kernel, not FlashAttention (CUDA; probed)."""
        sampling = _cuda_module("sampling_triton") if on_cuda else None
        self._sampler = None if sampling is None else sampling.gumbel_sample
        self.fused_sampling = self._sampler is not None
        """Whether decode steps draw the next tokens themselves (the fused Triton sampler on
        CUDA, inside the step's CUDA graph; checked against torch on the first decode)."""

    @property
    def rows(self) -> int:
        """Running rows (slots ``0..rows-1``)."""
        return int(self.lengths.shape[0])

    # ----- rows -----
    def append(self, kv: PrefillKV, index: list[int] | None = None) -> None:
        """Add prefilled rows after the running ones: rows ``index`` of ``kv`` (repeats
        allowed: a prompt's samples), each written from the prefill's K/V into its own pages."""
        index = list(range(kv.rows)) if index is None else index
        start, lengths = self.rows, kv.lengths[index].tolist()
        self._ensure_table(start + len(index), max(max(lengths), self._longest()) + 1)
        self._grow(self.cache.used_pages + sum(self.cache.pages_for(n) for n in lengths))
        self.cache.add_rows(lengths)
        self.cache.write(start, kv, index)
        self.lengths = torch.cat([self.lengths, kv.lengths[index]])

    def keep(self, index: list[int]) -> None:
        """Keep running rows ``index`` (in that order) as rows ``0..len-1``; the others' pages
        go back to the pool (no K/V moves)."""
        self.cache.keep(index)
        self.lengths = self.lengths[torch.tensor(index, dtype=torch.long)]

    def clear(self) -> None:
        """Drop every running row (the pool stays)."""
        self.cache.clear()
        self.lengths = torch.zeros(0, dtype=torch.long)

    def release(self) -> None:
        """Drop rows, the KV pool and the captured graphs."""
        self.clear()
        self.graphs.drop()
        self._fused = None
        self.cache.free()

    def _fused_layers(self) -> list[FusedLayer] | None:
        """The layers' fused projections (built now if needed; None off CUDA)."""
        if self._fused is None and self.device.type == "cuda":
            self._fused = [FusedLayer.of(layer) for layer in self.layers]
        return self._fused

    def _longest(self) -> int:
        return int(self.lengths.max()) if self.rows else 0

    def _ensure_table(self, rows: int, length: int) -> None:
        if self.cache.ensure_table(row_bucket(rows) if self.use_graphs else rows, length):
            self.graphs.drop()

    def _grow(self, pages: int) -> None:
        """A pool that holds ``pages`` pages in use (the reserved size, at most what the device
        has free, when it must grow)."""
        limit = None
        if self.device.type == "cuda" and self.cache.pool_target(pages, self.pool_pages):
            free, total = torch.cuda.mem_get_info(self.device)
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(
                self.device)
            if not self.cache.used_pages:  # the old pool goes before the new one comes
                free += self.cache.allocated_tokens * self.cache.bytes_per_token
            page_bytes = self.cache.bytes_per_token * self.cache.page_size
            headroom = max(POOL_HEADROOM * total, self.activation_bytes + (1 << 29))
            limit = int((free - headroom) // page_bytes) - 1
        if self.cache.ensure_pool(pages, self.pool_pages, limit):
            logger.info("KV pool: %d pages of %d tokens (%.2f GiB) for %d pages in use, reserved "
                        "%s, device limit %s", self.cache.pages_cap, self.cache.page_size,
                        self.cache.allocated_tokens * self.cache.bytes_per_token / 2**30, pages,
                        self.pool_pages, limit)
            self.graphs.drop()
            if self.device.type == "cuda":  # the old pool and the graphs' pool go back to the
                torch.cuda.empty_cache()     # device: what the budget counts is what is held

    def reserve(self, rows: int, length: int, pages: int, pool: int | None = None,
                prefill_tokens: int = 0) -> None:
        """Room for ``rows`` running rows of up to ``length`` tokens that hold ``pages`` pages
        in all at their final lengths (the running rows and the ones about to join); a pool
        that must grow is allocated with ``pool`` token slots (a budget), else twice its size,
        leaving the device what prefills of ``prefill_tokens`` and the graphs of ``rows`` rows
        need (:func:`~megarl.rollout.local.kv_cache.activation_headroom`)."""
        self.activation_bytes = activation_headroom(
            self.model.config, self.cache.bytes_per_token, self.dtype.itemsize, prefill_tokens,
            rows, self.use_graphs)
        self.pool_pages = self._pool_pages(pool)
        self._ensure_table(rows, length + 1)
        self._grow(pages)

    def peak_kv_tokens(self, pages: int, pool: int | None = None) -> int:
        """Token slots allocated at the peak of :meth:`reserve` with ``pages`` and ``pool``."""
        return self.cache.peak_tokens(pages, self._pool_pages(pool))

    def _pool_pages(self, pool: int | None) -> int | None:
        """The usable pages of a pool of ``pool`` token slots (one page is scratch)."""
        return None if pool is None else pool // self.cache.page_size - 1

    # ----- forward pieces -----
    def _norm(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return F.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)
        return module(x)

    def _tables(self, h: torch.Tensor, positions: torch.Tensor):
        cos, sin = self.model.model.rotary_emb(h[None], positions[None])
        return cos[0, :, None, :], sin[0, :, None, :]

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, tables, fast: bool):
        if fast and self._kernels is not None and self._kernels.rope_supported(q):
            cos, sin = tables
            return self._kernels.rope_pair(q, k, cos[:, 0], sin[:, 0], 0, 1.0)
        return _rope(q, *tables), _rope(k, *tables)

    def _layer(self, index: int, h: torch.Tensor, tables, attend, routes: list,
               step: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """One decoder layer on ``h [n, H]``; ``step`` holds a decode step's cache slots and
        positions (None in the prefill)."""
        layer = self.layers[index]
        fused = self._fused_layers()
        fused = fused[index] if fused is not None else None
        attn, n = layer.self_attn, h.shape[0]
        x = self._norm(layer.input_layernorm, h)
        if fused is not None and fused.qkv is not None:
            q, k, v = (t.unflatten(-1, (-1, self.head_dim))
                       for t in fused.qkv(x).split(fused.qkv_sizes, dim=-1))
        else:
            q = attn.q_proj(x).view(n, -1, self.head_dim)
            k = attn.k_proj(x).view(n, -1, self.head_dim)
            v = attn.v_proj(x).view(n, -1, self.head_dim)
        # the prefill runs before the first decode step checks the fast kernels
        fast = self.fast_kernels and (step is not None or self._fast_checked)
        q_in = self._fused_attention_input(index, attn, q, k, v, tables, step) if fast else None
        if q_in is not None:  # K and V are in the cache already
            h = h + attn.o_proj(attend(q_in, None, None))
        else:
            if hasattr(attn, "q_norm"):
                q, k = self._norm(attn.q_norm, q), self._norm(attn.k_norm, k)
            q, k = self._rotate(q, k, tables, fast)
            h = h + attn.o_proj(attend(q, k, v))
        x = self._norm(layer.post_attention_layernorm, h)
        mlp = layer.mlp
        if not hasattr(mlp, "experts"):
            if fused is not None and fused.gate_up is not None and self._plain_silu():
                return h + mlp.down_proj(self._swiglu(fused.gate_up(x)))
            return h + mlp(x)
        all_experts = step is not None and self._all_experts_ok(mlp.experts, n)
        dense = self._fused_routing(mlp.gate, x, routes) if all_experts else None
        if dense is not None:
            return h + self._all_experts(mlp.experts, x, dense)
        _, weights, experts = mlp.gate(x)
        routes.append(experts)
        if all_experts:
            dense = torch.zeros(n, mlp.experts.num_experts, dtype=x.dtype, device=x.device)
            return h + self._all_experts(mlp.experts, x, dense.scatter_(1, experts,
                                                                         weights.to(x.dtype)))
        if self.grouped_experts and self._dense_experts(mlp.experts):
            return h + grouped_experts(mlp.experts, x, experts, weights, self._swiglu)
        return h + mlp.experts(x, experts, weights)

    def _fused_attention_input(self, index: int, attn: nn.Module, q: torch.Tensor,
                               k: torch.Tensor, v: torch.Tensor, tables,
                               step: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
        """In a decode step: q/k RMSNorm, RoPE and the K/V cache write in one Triton launch;
        returns the queries (None where the kernel does not apply: the caller does it)."""
        kernels = self._decode_kernels
        if step is None or kernels is None:
            return None
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        cos, sin = tables
        args = (q, k, v, None if q_norm is None else q_norm.weight,
                None if k_norm is None else k_norm.weight, cos[:, 0], sin[:, 0],
                self.cache.keys[index], self.cache.values[index], step["slots"],
                step["offsets"])
        if not kernels.qk_norm_rope_cache_supported(*args):
            return None
        eps = q_norm.variance_epsilon if q_norm is not None else 0.0
        return kernels.qk_norm_rope_cache(*args[:5], eps, *args[5:])

    def _fused_routing(self, gate: nn.Module, x: torch.Tensor, routes: list
                       ) -> torch.Tensor | None:
        """HF's top-k router (softmax, top-k, renormalisation) as one Triton launch after its
        linear: the dense ``[n, E]`` weights (the chosen experts go to ``routes``), or None
        where it does not apply."""
        kernels = self._decode_kernels
        if kernels is None or not (hasattr(gate, "top_k") and hasattr(gate, "norm_topk_prob")):
            return None
        logits = F.linear(x, gate.weight)
        if not kernels.route_topk_supported(logits, gate.top_k):
            return None
        dense, chosen = kernels.route_topk(logits, gate.top_k, gate.norm_topk_prob)
        routes.append(chosen)
        return dense

    def _plain_silu(self) -> bool:
        return getattr(self.model.config, "hidden_act", None) == "silu"

    def _dense_experts(self, experts: nn.Module) -> bool:
        """Whether ``experts`` is transformers' fused SwiGLU expert block in the model's dtype
        (not FP8, which has its own grouped GEMMs)."""
        return (self.fast_kernels and hasattr(experts, "gate_up_proj")
                and experts.gate_up_proj.dtype == self.dtype
                and not getattr(experts, "is_transposed", False)
                and not getattr(experts, "has_bias", False)
                and getattr(self.model.config, "hidden_act", None) == "silu")

    def _all_experts_ok(self, experts: nn.Module, rows: int) -> bool:
        """Whether a decode step runs every expert on every row (few rows: the same weight
        bytes as routing, a handful of kernels instead of a sort and a grouped GEMM)."""
        return self._dense_experts(experts) and rows * experts.num_experts <= ALL_EXPERTS_ROWS

    def _all_experts(self, experts: nn.Module, x: torch.Tensor,
                     dense: torch.Tensor) -> torch.Tensor:
        """Every expert on every row, summed with the router weights ``dense [n, E]`` (zero for
        experts a row did not choose): two GEMMs over all experts' weights and a weighted sum."""
        n, num = x.shape[0], experts.num_experts
        up_w = experts.gate_up_proj  # [E, 2I, H]
        gate_up = F.linear(x, up_w.view(-1, up_w.shape[-1])).view(n * num, up_w.shape[1])
        act = self._swiglu(gate_up).view(n, num, -1).transpose(0, 1)  # [E, n, I]
        out = torch.bmm(act, experts.down_proj.transpose(1, 2))  # [E, n, H]
        return torch.bmm(dense[:, None, :], out.transpose(0, 1))[:, 0]

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fast_kernels and self._kernels is not None:
            return self._kernels.SwiGLU.apply(gate_up, None)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self._norm(self.model.model.norm, h)).float()

    # ----- prefill -----
    @torch.no_grad()
    def prefill(self, contexts: list[list[int]], want_routes: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None, PrefillKV]:
        """Run prompts right-padded; returns last-token logits ``[n, V]`` fp32, routes
        ``[n, width, L, K]`` left-aligned like the HF path's (or None) and the rows' K/V."""
        n, width = len(contexts), max(len(c) for c in contexts)
        ids = torch.zeros(n, width, dtype=torch.long)
        for i, ctx in enumerate(contexts):
            ids[i, : len(ctx)] = torch.tensor(ctx)
        lengths = torch.tensor([len(c) for c in contexts])
        h = self.model.model.embed_tokens(ids.to(self.device)).view(n * width, -1)
        positions = torch.arange(width, device=self.device).repeat(n)
        tables = self._tables(h, positions)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []

        def attend(q, k, v):
            """Causal SDPA over the right-padded rows; keeps their K/V."""
            q, k, v = (t.view(n, width, -1, self.head_dim) for t in (q, k, v))
            keys.append(k)
            values.append(v)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                scale=self.scale, enable_gqa=q.shape[2] != k.shape[2])
            return out.transpose(1, 2).reshape(n * width, -1)

        routes: list[torch.Tensor] = []
        for index in range(len(self.layers)):
            h = self._layer(index, h, tables, attend, routes)
        last = (lengths - 1 + torch.arange(n) * width).to(self.device)
        logits = self._head(h.index_select(0, last))
        left = None
        if want_routes and routes:
            right = torch.stack(routes, dim=1).view(n, width, len(routes), -1)
            right = right.to("cpu", torch.int32)
            left = torch.zeros_like(right)
            for i, length in enumerate(lengths.tolist()):
                left[i, width - length:] = right[i, :length]
        return logits, left, PrefillKV(keys, values, lengths)

    # ----- decode -----
    def _attend_decode(self, index: int, q, k, v, step: dict[str, torch.Tensor], span: int):
        """Write this step's K/V at each row's position, then attend over the row's tokens."""
        rows, positions, table = q.shape[0], step["positions"], step["table"]
        kc, vc = self.cache.keys[index], self.cache.values[index]
        if k is not None:  # (None: the fused attention-input kernel wrote them)
            kc[step["slots"], step["offsets"]] = k
            vc[step["slots"], step["offsets"]] = v
        if self.flash and self.split_attention:
            out = self._split_attention.decode_attention(q, kc, vc, step["used"], self.scale,
                                                         pages=table)
            return out.reshape(rows, -1)
        if not self.flash:  # the pages that hold the first ``span`` tokens
            table = table[:, : self.cache.pages_for(span)]
        keys, vals = (pool[table.long()].flatten(1, 2) for pool in (kc, vc))  # rows' tokens
        if self.flash:
            length = keys.shape[1]
            out = torch.ops.aten._flash_attention_forward(
                q, keys.flatten(0, 1), vals.flatten(0, 1), step["cu_q"], step["cu_q"] * length,
                1, length, 0.0, False, False, scale=self.scale, seqused_k=step["used"])[0]
            return out.reshape(rows, -1)
        keys, vals = keys[:, :span].float(), vals[:, :span].float()
        qf = q.float().view(rows, self.kv_heads, -1, self.head_dim)
        scores = torch.einsum("bkgd,btkd->bkgt", qf, keys) * self.scale
        hidden = torch.arange(span, device=self.device)[None, :] > positions[:, None]
        probs = scores.masked_fill(hidden[:, None, None, :], float("-inf")).softmax(dim=-1)
        out = torch.einsum("bkgt,btkd->bkgd", probs, vals).to(q.dtype)
        return out.reshape(rows, -1)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, span: int,
             sampling: tuple[torch.Tensor, torch.Tensor] | None = None,
             table: torch.Tensor | None = None):
        """One decode step of all rows: logits ``[rows, V]`` fp32, routes ``[rows, L, K]`` and,
        with ``sampling`` (temperatures, seeds), the drawn tokens and their log-probs as
        ``[2, rows]`` fp64. ``table``: the page table's rows to use (default: the running
        rows'; a graph's warm-up passes zeros, so that it writes to the scratch page only)."""
        h = self.model.model.embed_tokens(tokens)
        tables = self._tables(h, positions)
        rows, size = tokens.shape[0], self.cache.page_size
        table = self.cache.table[:rows] if table is None else table
        column = torch.div(positions, size, rounding_mode="floor")
        # a padded graph row is at position 0 of a table row of zeros: the scratch page
        step = {"positions": positions, "table": table, "offsets": positions - column * size,
                "slots": table.gather(1, column[:, None])[:, 0].long(),
                "cu_q": torch.arange(rows + 1, device=self.device, dtype=torch.int32),
                "used": (positions + 1).to(torch.int32)}
        routes: list[torch.Tensor] = []
        for index in range(len(self.layers)):
            attend = (lambda q, k, v, i=index: self._attend_decode(i, q, k, v, step, span))
            h = self._layer(index, h, tables, attend, routes, step)
        logits = self._head(h)
        picks = None
        if sampling is not None:
            drawn, logprobs = self._sampler(logits, sampling[0], sampling[1], positions)
            picks = torch.stack([drawn.double(), logprobs.double()])
        return logits, (torch.stack(routes, dim=1) if routes else None), picks

    @torch.no_grad()
    def decode(self, tokens: list[int], sampling: FusedSampling | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[list, list] | None]:
        """Feed one token per running row: next-token logits ``[rows, V]`` fp32, the fed
        tokens' routes ``[rows, L, K]`` (None for dense models) and, with ``sampling`` (when
        :attr:`fused_sampling`), the next tokens and their log-probs drawn in the step."""
        self._ensure_table(self.rows, self._longest() + 1)
        self._take_pages()
        ids = torch.tensor(tokens, dtype=torch.long)
        if (self.flash or self.fast_kernels or self.fused_sampling) and not self._fast_checked:
            self._check_fast_paths(ids)
        if not self.fused_sampling:
            sampling = None
        if self.use_graphs and self.graphs.bucket(self.rows) is None:
            self.use_graphs = False
        if self.use_graphs:
            logits, routes, picks = self.graphs.replay(ids, sampling)
        else:
            positions = self.lengths.to(self.device)
            inputs = None if sampling is None else (sampling.temperatures, sampling.seeds)
            logits, routes, picks = self.step(ids.to(self.device), positions,
                                               self._longest() + 1, inputs)
        self.lengths = self.lengths + 1
        if picks is None:
            return logits, routes, None
        picks = picks.cpu()  # the step's one device synchronisation
        return logits, routes, (picks[0].long().tolist(), picks[1].float().tolist())

    def step_pages(self) -> tuple[list[int], list[bool], int]:
        """Per running row the pages it holds and whether the next decode step gives it one
        more (its next token starts a page), and the free pages."""
        held = [len(pages) for pages in self.cache.row_pages]
        wants = [n >= size * self.cache.page_size
                 for n, size in zip(self.lengths.tolist(), held)]
        return held, wants, self.cache.free_pages

    def _take_pages(self) -> None:
        """Give each row whose next token starts a page that page. A pool that nothing reserved
        grows first; a reserved one does not (the engine retracts rows before it runs short)."""
        size = self.cache.page_size
        rows = (self.lengths % size == 0).nonzero()[:, 0].tolist()
        if not rows:
            return
        lengths = (self.lengths[rows] + 1).tolist()
        need = sum(self.cache.pages_for(n) - len(self.cache.row_pages[r])
                   for r, n in zip(rows, lengths))
        if need > self.cache.free_pages and self.pool_pages is None:
            self._grow(self.cache.used_pages + need)
        self.cache.extend(rows, lengths)

    def _check_fast_paths(self, ids: torch.Tensor) -> None:
        """Run the first decode step with the fast kernels (FlashAttention, Triton RoPE and
        SwiGLU, all-experts MoE) and with the reference path (fp32 attention, HF's ops); both
        write the same K/V. Keep the fast kernels only if their logits agree."""
        self._fast_checked = True
        positions = self.lengths.to(self.device)
        span = self._longest() + 1
        greedy = (torch.zeros(len(ids), device=self.device),
                  torch.zeros(len(ids), dtype=torch.long, device=self.device))
        for attempt in (0, 1):
            try:
                with unquantized_activations():  # FP8 layers w8a16 in both paths (its doc: why)
                    fast, _, picks = self.step(ids.to(self.device), positions, span,
                                                greedy if self.fused_sampling else None)
                break
            except Exception as err:  # noqa: BLE001 (Triton's compile errors are no RuntimeError)
                if attempt == 0 and self.split_attention:  # FlashAttention's, then none
                    logger.warning("split-K decode attention failed (%s)", err)
                    self.split_attention = False
                    continue
                logger.warning("fast decode kernels failed (%s); using the reference path", err)
                self.flash = self.fast_kernels = self.fused_sampling = False
                return
        flash, self.flash, self.fast_kernels = self.flash, False, False
        with unquantized_activations():
            ref, _, _ = self.step(ids.to(self.device), positions, span)
        error = float((fast - ref).abs().max() / ref.abs().max().clamp(min=1e-6))
        ok = error < 0.05
        self.flash, self.fast_kernels = flash and ok, ok
        if self.moe and ok:
            layer = next(lay for lay in self.layers if hasattr(lay.mlp, "experts"))
            self.grouped_experts = self._dense_experts(layer.mlp.experts) and \
                grouped_experts_match(layer.mlp, self._swiglu)
        logger.info("fast decode kernels vs reference: relative max error %.2e (%s)", error,
                    "using them" if ok else "using the reference path")
        if picks is not None:  # greedy picks and log-probs of the fused sampler vs torch
            expected = torch.log_softmax(fast, dim=-1)
            tokens_ok = torch.equal(picks[0].long(), fast.argmax(dim=-1))
            lp_error = float((picks[1] - expected.gather(1, picks[0].long()[:, None])[:, 0])
                             .abs().max())
            self.fused_sampling = tokens_ok and lp_error < 1e-3
            logger.info("fused sampler vs torch: picks %s, log-prob error %.1e (%s)",
                        "equal" if tokens_ok else "differ", lp_error,
                        "using it" if self.fused_sampling else "sampling with torch")
