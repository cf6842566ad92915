"""The embedded engine's memory: what it gives up while a colocated trainer runs, and how a
generation step that ran out of device memory is recovered (engine.py's module docstring).

:class:`EngineMemory` holds these methods of :class:`~megarl.rollout.local.engine.LocalEngine`;
they run on the engine thread.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from megarl.faults import oom_point
from megarl.memory import log_held_device_memory
from megarl.rollout.local.requests import Prefill

if TYPE_CHECKING:
    from megarl.rollout.local.engine import LocalEngine

logger = logging.getLogger("megarl.rollout.local.engine")

OOM_RETRIES = 3
"""Out-of-memory steps in a row the engine recovers from before it fails the requests."""
MIN_PREFILL_TOKENS = 512
"""The prefill budget an out-of-memory prefill halves down to; below it, the rows are retracted
and the KV pool shrinks (module docstring)."""
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class EngineMemory:
    """Release and resume of the engine's memory, and out-of-memory recovery."""

    def release_memory(self: LocalEngine, tags: list[str]) -> str:
        """Give up memory while training runs (engine thread only); generation waits until
        :meth:`resume_memory`. ``weights``: :meth:`ModelRunner.offload` (host copy or drop)."""
        unknown = sorted(set(tags) - set(MEMORY_TAGS))
        if unknown:
            raise ValueError(f"tags: unknown {unknown}; use {list(MEMORY_TAGS)} or null")
        self._settle(compact=True)
        if self._rows:
            raise ValueError("requests are running: call /pause_generation (mode abort or "
                             "retract) before releasing memory")
        if "kv_cache" in tags:
            self.runner.release_kv_cache()
            # budgets cut by an out-of-memory step come back: the next pool is sized against
            # what the device then has free
            self.max_total_tokens = self._max_total_tokens
            self.max_prefill_tokens = self._max_prefill_tokens
        self.runner.clear_rows()
        if "weights" in tags and "weights" not in self.released:
            self.runner.offload()
        self.released |= set(tags)
        if self.runner.device.type == "cuda" and {"weights", "kv_cache"} <= self.released:
            log_held_device_memory(self.runner.device)
        return f"released {sorted(self.released)}"

    def resume_memory(self: LocalEngine, tags: list[str]) -> str:
        """Take back what :meth:`release_memory` gave up (engine thread only). When the device
        has no room the allocator's out-of-memory error propagates and what failed stays
        released (``MEGARL_OOM_AT=resume_rollout`` injects one, :mod:`megarl.faults`)."""
        if "weights" in tags and "weights" in self.released:
            oom_point("resume_rollout")
            self.runner.reload()
        self.released -= set(tags)
        return f"still released: {sorted(self.released)}"

    def _recover_from_oom(self: LocalEngine, err: torch.OutOfMemoryError) -> bool:
        """Retract every row, free the KV cache, shrink the budgets and queue the rows again
        (module docstring); False once :data:`OOM_RETRIES` steps in a row ran out of memory."""
        self._oom_streak += 1
        if self._oom_streak > OOM_RETRIES:
            return False
        if self._in_forward and self.max_prefill_tokens > MIN_PREFILL_TOKENS:
            return self._shrink_prefill(err)
        held = self.runner.kv_allocated_tokens
        in_prefill = bool(self._prefilling)
        again: list[Prefill] = []
        for unit in self._prefilling:  # not yet prefilled, or sampled a first token
            live = [s for s in unit.samples if s.finish is None]
            fresh = [s for s in live if not s.output_ids]
            if fresh:
                again.append(Prefill(fresh, unit.context))
            again += [Prefill.retracted(s)
                      for s in live if s.output_ids]
        again += [Prefill.retracted(s)
                  for s in self._rows if s.finish is None]
        self._retire([s for s in self._rows if s.finish is not None])
        self._prefilling = []
        self._set_rows([])
        self.runner.release_kv_cache()
        self._waiting.extendleft(reversed(again))
        budget = self.max_total_tokens
        if budget is not None and held:
            self.max_total_tokens = max(1, min(budget, held * 3 // 4))
        if in_prefill:
            self.max_prefill_tokens = max(1, self.max_prefill_tokens // 2)
        self.oom_recoveries += 1
        logger.warning(
            "out of memory in a generation step (%d in a row; %s): retracted %d row(s), freed "
            "the KV cache of %d token slots; KV budget %s -> %s token slots, prefill budget %d "
            "tokens", self._oom_streak, " ".join(str(err).split())[:200], len(again), held,
            budget, self.max_total_tokens, self.max_prefill_tokens)
        return True

    def _shrink_prefill(self: LocalEngine, err: torch.OutOfMemoryError) -> bool:
        """A prefill's forward ran out of memory: its prompts wait again, the prefill budget
        halves, and the running rows and the KV pool stay (retracting them would not give the
        activations the memory: the pool keeps its size)."""
        self._waiting.extendleft(reversed(self._prefilling))
        self._prefilling, self._in_forward = [], False
        self.max_prefill_tokens = max(MIN_PREFILL_TOKENS, self.max_prefill_tokens // 2)
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        self.oom_recoveries += 1
        logger.warning("out of memory in a prefill (%d in a row; %s): its prompts wait again, "
                       "the %d running rows stay; prefill budget %d tokens", self._oom_streak,
                       " ".join(str(err).split())[:200], len(self._rows),
                       self.max_prefill_tokens)
        return True
