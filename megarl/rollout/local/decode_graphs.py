"""The native decoder's CUDA graphs: one captured decode step per bucket of running rows.

A step's static inputs are the tokens and positions (one pinned staging buffer, one asynchronous
copy per replay) and the fused sampler's temperatures and seeds; the KV pools and the page table
are read where they live, so a graph stays valid until they are allocated anew
(:meth:`DecodeGraphs.drop`). Padded rows of a bucket are at position 0 of a page-table row of
zeros: they write to the scratch page and attend to one token.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megarl.rollout.local.kv_cache import row_bucket
from megarl.rollout.local.sampling import FusedSampling

if TYPE_CHECKING:
    from megarl.rollout.local.static_kv import NativeDecoder

logger = logging.getLogger(__name__)


@dataclass
class Graph:
    """One captured decode step for a bucket of rows and its static inputs / outputs."""

    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor
    positions: torch.Tensor
    logits: torch.Tensor
    routes: torch.Tensor | None
    temperatures: torch.Tensor | None = None
    seeds: torch.Tensor | None = None
    picks: torch.Tensor | None = None
    """``[2, rows]`` fp64: the tokens and log-probs drawn by the fused sampler."""
    inputs: torch.Tensor | None = None
    """``[2, rows]`` int64 on the device: ``tokens`` and ``positions`` are its rows."""
    staged: torch.Tensor | None = None
    """``inputs`` in pinned host memory: the next replay's tokens and positions, which one
    asynchronous copy moves to the device."""
    sampling: FusedSampling | None = None
    """The sampler inputs last copied into ``temperatures`` / ``seeds``."""


class DecodeGraphs:
    """The captured decode steps of one :class:`NativeDecoder`, by row bucket."""

    def __init__(self, decoder: NativeDecoder) -> None:
        self.decoder = decoder
        self.captured: dict[int, Graph] = {}
        self._pool = None
        self.capture_failures = 0
        """Captures that failed (the decoder then decodes eagerly)."""
        self.captures = 0
        self.capture_s = 0.0
        """Graphs captured and the seconds their capture took (warm-up step included), since
        the decoder was built: every drop makes the buckets in use captured again."""

    def drop(self) -> None:
        """Forget the captured graphs and their memory pool. The pool handle goes with them: the
        caching allocator keeps a pool only while some graph captured into it lives, and a
        capture into the handle of a dead pool fails its ``use_count > 0`` assertion (on the
        H200, every capture after the first KV regrowth did, and decoding went eager). The
        dead pool's blocks go back to the device with ``empty_cache``."""
        self.captured.clear()
        self._pool = None

    def bucket(self, rows: int) -> Graph | None:
        """The graph for ``rows`` running rows' bucket, captured on first use (None if capture
        fails: decoding then stays eager)."""
        bucket = row_bucket(rows)
        graph = self.captured.get(bucket)
        if graph is None:
            start = time.perf_counter()
            try:
                graph = self._capture(bucket)
            except RuntimeError as err:
                self.capture_failures += 1
                logger.warning("CUDA graph capture failed (%s); decoding without graphs", err)
                return None
            self.captured[bucket] = graph
            self.captures += 1
            self.capture_s += time.perf_counter() - start
        return graph

    def replay(self, ids: torch.Tensor, sampling: FusedSampling | None):
        """One decode step of the running rows (fed ``ids``): logits, routes, picks."""
        decoder = self.decoder
        rows = decoder.rows
        graph = self.captured[row_bucket(rows)]
        staged = graph.staged
        staged[0, :rows] = ids
        staged[0, rows:] = 0
        staged[1, :rows] = decoder.lengths
        staged[1, rows:] = 0  # padded rows: position 0 of a table row of zeros, the scratch page
        # the pinned buffer is written again only after this step's results reached the host
        graph.inputs.copy_(staged, non_blocking=True)
        if graph.temperatures is not None and sampling is not graph.sampling:
            graph.sampling = sampling
            if sampling is None:
                graph.temperatures.zero_()
            else:
                graph.temperatures[:rows].copy_(sampling.temperatures)
                graph.temperatures[rows:].zero_()
                graph.seeds[:rows].copy_(sampling.seeds)
        graph.graph.replay()
        routes = None if graph.routes is None else graph.routes[:rows]
        picks = None if sampling is None or graph.picks is None else graph.picks[:, :rows]
        return graph.logits[:rows], routes, picks

    def _capture(self, bucket: int) -> Graph:
        """Capture the decode step for ``bucket`` rows (warm-up on a side stream first)."""
        decoder = self.decoder
        device = decoder.device
        inputs = torch.zeros(2, bucket, dtype=torch.long, device=device)
        tokens, positions = inputs[0], inputs[1]
        span = decoder.cache.len_cap
        sampling = None
        if decoder.fused_sampling:
            sampling = (torch.zeros(bucket, device=device),
                        torch.zeros(bucket, dtype=torch.long, device=device))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # the warm-up runs: it must not write the rows' pages
            decoder.step(tokens, positions, span, sampling,
                         torch.zeros_like(decoder.cache.table[:bucket]))
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, routes, picks = decoder.step(tokens, positions, span, sampling)
        temperatures, seeds = sampling if sampling is not None else (None, None)
        staged = torch.empty(2, bucket, dtype=torch.long, pin_memory=True)
        return Graph(graph, tokens, positions, logits, routes, temperatures, seeds, picks,
                     inputs, staged)
