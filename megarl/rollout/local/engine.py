"""The embedded engine's scheduler: continuous batching on one thread that owns the model.

Requests (one prompt, ``n`` samples) wait in a queue; every step admits waiting prompts up to
the row, prefill-token and KV-cache budgets (``max_total_tokens``: the token slots the KV cache
may hold at its peak, each row at its final length: on the native path the pages of each row's
own length, as SGLang's ``--max-total-tokens`` bounds its pool), prefills them together (each
context once, its KV copied to its rows: a prompt's ``n`` samples, and requests of the same
prompt admitted together, e.g. a client's one request per sample, as SGLang's radix cache
prefills a shared prefix once),
samples their first tokens and adds them to the running batch; then the whole batch decodes one
token. Requests that arrive while others run join at the next step. A row may name a LoRA
adapter (``lora_path``) applied to its rows only (lora_serving.py; counted per adapter).

A step that runs out of device memory (``torch.OutOfMemoryError``: e.g. a colocated trainer's
leftovers) fails nothing at first (engine_memory.py). A prefill whose forward ran out puts its
prompts back and halves the prefill budget; the running rows and the KV pool stay. Any other
step retracts the running rows with their tokens (as ``/pause_generation`` ``retract`` does),
frees the KV cache and decode graphs, shrinks the KV budget to three quarters of what the cache
held (the prefill budget halves if a prefill failed), and queues the rows again. The budgets
come back when the KV cache is next released;
:data:`~megarl.rollout.local.engine_memory.OOM_RETRIES` failures in a row fail the requests.

Everything that touches the model (generation, weight loads, aborts, pause modes) runs on the
engine thread between steps (other threads hand it functions: :meth:`LocalEngine.call`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from megarl.faults import engine_step_delay, oom_point
from megarl.rollout.interface import PauseMode
from megarl.rollout.local.admission import KVAdmission, final_length
from megarl.rollout.local.engine_memory import MEMORY_TAGS, OOM_RETRIES, EngineMemory  # noqa: F401
from megarl.rollout.local.fp8_layers import experts_backend, gemm_backend
from megarl.rollout.local.model_runner import ModelRunner
from megarl.rollout.local.requests import Prefill, Request, Sample, SampleResult
from megarl.rollout.local.sampling import BatchSampling, FusedSampling, RowSampling, sample_next
from megarl.rollout.local.step_profile import StepProfile, Timer

logger = logging.getLogger(__name__)
T = TypeVar("T")

RECHECK_STEPS = 16
"""Decode steps a prompt that found the KV budget full waits before admission counts again,
unless a running row leaves first (rows that may stop early need a little less each step)."""
DEFAULT_SAMPLING_SEED = 42
"""The seed of requests without ``sampling_seed`` under deterministic inference (SGLang's)."""


class LocalEngine(EngineMemory):
    """Continuous-batching generation over a :class:`ModelRunner`, run on its own thread."""

    def __init__(self, runner: ModelRunner, *, max_running_requests: int = 256,
                 max_prefill_tokens: int = 16384, weight_version: str = "default",
                 seed: int | None = None, deterministic: bool = False,
                 max_total_tokens: int | None = None) -> None:
        self.runner = runner
        self.max_total_tokens = max_total_tokens
        """KV token slots the cache may hold at its peak (None: no limit); an out-of-memory
        step cuts it until the KV cache is next released."""
        self._max_total_tokens = max_total_tokens
        self.deterministic = deterministic
        """Honour ``sampling_seed`` (SGLang's ``--enable-deterministic-inference``): every sample
        of a request draws from that seed alone; otherwise it is ignored."""
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self._max_prefill_tokens = max_prefill_tokens
        self.weight_version = weight_version
        self.paused = False
        self.released: set[str] = set()
        self.steps = 0
        """Generation steps run so far (``/health`` takes any progress as a sign of life)."""
        self.oom_recoveries = 0
        self.admission = KVAdmission()
        """Expected lengths for admission, retraction for want of KV pages (admission.py)."""
        """Out-of-memory steps recovered from by retracting the rows (module docstring)."""
        self.lora_requests: Counter[str] = Counter()  # per lora_path ("": the base model)
        self.profile = StepProfile()
        """Seconds and work of each kind of step since the start (step_profile.py)."""
        self._oom_streak = 0
        self._step_delay_s = engine_step_delay()
        self._generator = torch.Generator()
        self._generator.manual_seed(seed if seed is not None else torch.seed())
        # keys of unseeded rows for the fused sampler, from a stream of their own (the
        # sequential sampler's draws stay as they were)
        self._row_seeds = torch.Generator()
        self._row_seeds.manual_seed(self._generator.initial_seed() + 1)
        self._inbox: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            queue.Queue())
        self._waiting: deque[Prefill] = deque()
        self._rows: list[Sample] = []
        self._rows_sampling: BatchSampling | None = None
        self._prefilling: list[Prefill] = []
        self._blocked: tuple[Prefill, int, int] | None = None  # (head, rows, step) of a full budget
        self._in_forward = False  # a prefill's forward is running (_recover_from_oom)
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="megarl-engine", daemon=True)

    # ----- public, thread-safe -----
    def start(self) -> None:
        """Start the engine thread."""
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything and stop the engine thread."""
        if self._thread.is_alive():
            self.call(lambda: self.abort_requests(None, "server shutting down")).result(timeout)
            self._stop = True
            self._inbox.put((lambda: None, concurrent.futures.Future()))
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs."""
        return self._thread.is_alive()

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future:
        """Run ``fn`` on the engine thread between steps; the future holds its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((fn, future))
        return future

    def submit(self, request: Request) -> concurrent.futures.Future:
        """Queue a request; its future resolves to ``list[SampleResult]`` (one per sample)."""
        self.call(lambda: self._enqueue(request))
        return request.future

    def abort(self, rid: str | None) -> concurrent.futures.Future:
        """Abort the request ``rid`` (None: all); their partial samples finish as ``abort``."""
        return self.call(lambda: self.abort_requests(rid, "aborted by request"))

    def pause(self, mode: PauseMode) -> concurrent.futures.Future:
        """Stop stepping; ``abort`` / ``retract`` / ``in_place`` decide what happens to rows."""
        return self.call(lambda: self._pause(mode))

    def resume(self) -> concurrent.futures.Future:
        """Step again after :meth:`pause`."""
        return self.call(self._resume)

    def load_state(self) -> dict[str, Any]:
        """``/get_server_info``'s counts (unlocked; generation_steps stay put while paused)."""
        running, fp8 = sum(s.finish is None for s in self._rows), self.runner.quantization
        return {"num_running_reqs": running, "num_waiting_reqs": len(self._waiting),
                "paused": self.paused, "released": sorted(self.released),
                "weight_version": self.weight_version, "generation_steps": self.steps,
                "oom_recoveries": self.oom_recoveries,
                "kv_retractions": self.admission.retractions,
                "step_profile": {**self.profile.snapshot(), **self.runner.graph_stats()},
                "fp8_gemm": gemm_backend(self.runner.device) if fp8 else None,
                "fp8_experts": experts_backend(self.runner.device) if fp8 else None,
                "lora_requests": dict(self.lora_requests) if self.runner.lora else None}

    @property
    def busy(self) -> bool:
        """Whether any request is running or waiting."""
        return bool(self._rows or self._waiting)

    # ----- engine thread -----
    def _loop(self) -> None:
        while not self._stop:
            with Timer() as waited:
                self._drain_inbox(block=self._idle())
            self.profile.add("idle_s", waited.s)
            if self._idle():
                continue
            self._guarded_step()
            if self._step_delay_s:
                time.sleep(self._step_delay_s)

    def _guarded_step(self) -> None:
        """One step; out of memory, recover (module docstring); any other error fails the
        requests, not the server."""
        try:
            self._step()
            self.steps += 1
            self._oom_streak = 0
        except torch.OutOfMemoryError as err:
            if not self._recover_from_oom(err):
                logger.exception("generation step failed: out of memory %d times in a row",
                                 self._oom_streak)
                self._fail_all(err)
        except Exception as err:  # the requests receive it
            logger.exception("generation step failed")
            self._fail_all(err)

    def _idle(self) -> bool:
        return self.paused or bool(self.released) or not (self._rows or self._waiting)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._run(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    @staticmethod
    def _run(fn: Callable[[], Any], future: concurrent.futures.Future) -> None:
        try:
            future.set_result(fn())
        except Exception as err:  # noqa: BLE001  (the caller receives it through the future)
            future.set_exception(err)

    def requests_using(self, adapter: str) -> int:
        """Requests running or waiting with LoRA adapter ``adapter`` (engine thread)."""
        rows = [*(u.samples[0] for u in self._waiting), *self._rows]
        return len({id(s.request) for s in rows if not s.finish and s.request.lora == adapter})

    def _enqueue(self, request: Request) -> None:
        runner, p = self.runner, request.params
        if request.lora is not None and request.lora not in getattr(runner.lora, "adapters", {}):
            request.future.set_exception(ValueError(f"lora_path {request.lora!r} was unloaded"))
            return
        self.lora_requests[request.lora or ""] += 1
        max_new = min(p.max_new_tokens, runner.context_length - len(request.prompt_ids))
        stop_ids = frozenset(p.stop_token_ids) | (
            frozenset() if p.ignore_eos else frozenset(runner.eos_token_ids))
        for j in range(p.n):
            sampling = RowSampling(p.temperature, p.top_p, p.top_k, p.min_p,
                                   *self._row_random(p.seed))
            request.samples.append(Sample(request, j, request.sample_rids[j], max_new, sampling,
                                          stop_ids))
        self._waiting.append(Prefill(list(request.samples), list(request.prompt_ids)))

    def _row_random(self, seed: int | None) -> tuple[torch.Generator | None, int]:
        """(generator, fused-sampler key) of a new row. Under deterministic inference both
        come from the request's seed (42 when unset), so the ``n`` samples of one request are
        identical, as in SGLang; otherwise the seed is ignored and the row draws from the
        engine's streams."""
        if self.deterministic:
            seed = DEFAULT_SAMPLING_SEED if seed is None else seed
            return torch.Generator().manual_seed(seed), seed
        return None, int(torch.randint(1 << 62, (1,), generator=self._row_seeds))

    def _admit(self) -> list[Prefill]:
        """Waiting prefills that fit the row, prefill-token and KV budgets (at least one if idle
        and its KV fits at all), with the KV cache sized for their final lengths."""
        if not self._waiting or self._still_blocked():
            return []
        budget = self.max_total_tokens
        if budget is not None:
            self._settle(compact=True)  # finished rows would hold KV slots
        admitted: list[Prefill] = []
        rows, width = len(self._rows), 0
        page = self.runner.kv_page_size
        final, slots = self.admission.held(self._rows, page)
        twins: dict[tuple, Prefill] = {}  # context (and adapter) -> the unit that prefills it
        while self._waiting:
            unit = self._waiting[0]
            key = (unit.samples[0].request.lora, *unit.context)
            twin = twins.get(key)  # the same context admitted in this pass: prefilled once
            new_width = max(width, len(unit.context))
            longest, unit_slots = self.admission.held(unit.samples, page)
            new_final, new_slots = max(final, longest), slots + unit_slots
            over_rows = rows + len(unit.samples) > self.max_running_requests
            over_tokens = twin is None and (new_width * (len(admitted) + 1)
                                            > self.max_prefill_tokens)
            if (over_rows and rows > 0) or (over_tokens and admitted):
                break
            if budget is not None:
                peak = self.runner.peak_kv_tokens(rows + len(unit.samples), new_final,
                                                  new_slots, budget)
                lone = self.runner.kv_row_slots(longest) + self.runner.kv_row_slots(1)  # + scratch
                if lone > budget:  # one sample alone would outgrow the pool: never admit it
                    self._refuse(self._waiting.popleft(), lone, budget)
                    continue
                if peak > budget:
                    if rows == 0 and not admitted:  # it would not fit on an idle engine either
                        self._refuse(self._waiting.popleft(), peak, budget)
                        continue
                    if not admitted:
                        self._blocked = (unit, len(self._rows), self.steps)
                    break
            self._waiting.popleft()
            if twin is None:
                admitted.append(unit)
                twins[key] = unit
            else:
                twin.samples.extend(unit.samples)
            rows += len(unit.samples)
            width, final, slots = new_width, new_final, new_slots
        if admitted:  # the table for every row that may run: its growth drops the graphs
            self.runner.reserve(max(rows, self.max_running_requests), final, slots, budget,
                                self.max_prefill_tokens)
        return admitted

    def _still_blocked(self) -> bool:
        """Whether the queue's head found the KV budget full within the last
        :data:`RECHECK_STEPS` steps and no running row has left since (counting every running
        row's expected length again would cost ~1 ms a step at 512 rows)."""
        blocked = self._blocked
        return (blocked is not None and blocked[0] is self._waiting[0]
                and blocked[1] == len(self._rows) and self.steps - blocked[2] < RECHECK_STEPS)

    def _refuse(self, unit: Prefill, peak: int, budget: int) -> None:
        """Finish a prompt whose samples' KV cannot fit the cache (as aborted, with why)."""
        samples = unit.samples
        message = (f"{len(samples)} sample(s) of up to {final_length(samples[0])} tokens need "
                   f"{peak} KV token slots; the engine holds {budget} (--max-total-tokens, or "
                   "--mem-fraction-static of the device); lower max_new_tokens or n, or give "
                   "the engine more memory")
        logger.warning("refused a request: %s", message)
        for s in samples:
            s.finish = {"type": "abort", "message": message}
        self._retire(samples)

    def _step(self) -> None:
        self._in_forward = False  # (a prefill that raised something else left it set)
        with Timer() as scheduled:
            admitted = self._admit()
        self.profile.add("schedule_s", scheduled.s)
        if admitted:
            self._prefilling = admitted  # failed with the others if the prefill raises
            with Timer() as ran:
                self._prefill(admitted)
            self.profile.prefill(sum(len(u.context) for u in admitted),
                                 sum(len(u.samples) for u in admitted), ran.s)
            self._prefilling = []
        if self._rows:
            self._decode()

    def _prefill(self, units: list[Prefill]) -> None:
        want_routes = any(s.request.return_routed_experts for u in units for s in u.samples)
        if self.runner.lora is not None:
            self.runner.lora.set_rows([u.samples[0].request.lora for u in units])
        self._in_forward = True  # out of memory in the forward: nothing changed yet
        out, kv = self.runner.prefill([u.context for u in units], want_routes)
        self._in_forward = False
        expand = [i for i, u in enumerate(units) for _ in u.samples]
        samples = [s for u in units for s in u.samples]
        if want_routes:
            assert out.routes is not None
            width = out.routes.shape[1]
            for i, unit in enumerate(units):
                real = out.routes[i, width - len(unit.context):].to(torch.int16)
                for s in unit.samples:
                    if s.request.return_routed_experts:
                        s.route_chunks = [real]
        logits = out.logits.index_select(0, torch.tensor(expand, device=out.logits.device))
        self._sample_into(samples, logits, BatchSampling.build(
            [s.sampling for s in samples], logits.device))
        keep = [k for k, s in enumerate(samples) if s.finish is None]
        self._retire(samples)
        self._settle(compact=True)
        self.runner.append_rows(kv, [expand[k] for k in keep])
        self._set_rows(self._rows + [samples[k] for k in keep])

    def _decode(self) -> None:
        oom_point("engine_decode")
        with Timer() as scheduled:
            self._make_room()
        self.profile.add("schedule_s", scheduled.s)
        if not self._rows:  # every row had finished
            return
        rows, finished = len(self._rows), sum(s.finish is not None for s in self._rows)
        with Timer() as ran:
            self._decode_rows()
        self.profile.decode(rows, finished, ran.s)

    def _decode_rows(self) -> None:
        self.admission.decoded()
        rows = self._rows  # finished rows stay until compaction; their results are ignored
        want_routes = any(s.request.return_routed_experts and s.finish is None for s in rows)
        if self.runner.lora is not None:
            self.runner.lora.set_rows([s.request.lora for s in rows])
        out = self.runner.decode([s.output_ids[-1] for s in rows], want_routes,
                                 sampling=self._fused_sampling())
        if out.routes is not None:
            for i, s in enumerate(rows):
                if s.request.return_routed_experts and s.finish is None:
                    s.route_chunks.append(out.routes[i].to(torch.int16))
        if out.sampled is not None:  # drawn inside the decode step (fused GPU sampler)
            self._append(rows, *out.sampled)
        else:
            self._sample_into(rows, out.logits, self._batch_sampling(out.logits.device))
        self._settle()

    def _make_room(self) -> None:
        """Retract rows until this decode step's new KV pages fit the pool (admission.py)."""
        pages = self.runner.kv_step_pages()
        if pages is None or sum(pages[1]) <= pages[2]:
            return
        self._settle(compact=True)  # finished rows hold pages too
        held, wants, free = self.runner.kv_step_pages()
        victims = self.admission.to_retract(self._rows, held, wants, free)
        if not victims:
            return
        out = set(victims)
        self._waiting.extendleft(reversed([
            Prefill.retracted(self._rows[i]) for i in victims]))
        keep = [i for i in range(len(self._rows)) if i not in out]
        self.runner.keep_rows(keep)
        self._set_rows([self._rows[i] for i in keep])
        logger.info("KV pool short: retracted %d row(s) (%d so far); %d run", len(victims),
                    self.admission.retractions, len(keep))

    def _batch_sampling(self, device: torch.device) -> BatchSampling:
        """The running rows' sampling settings (built once per batch composition)."""
        if self._rows_sampling is None:
            self._rows_sampling = BatchSampling.build([s.sampling for s in self._rows], device)
        return self._rows_sampling

    def _fused_sampling(self) -> FusedSampling | None:
        """The in-graph sampler's inputs for this decode step, when every row may use it (no
        top-k / top-p / min-p, no stop token held back by min_new_tokens)."""
        if not self.runner.fused_sampling or any(
                len(s.output_ids) < s.request.params.min_new_tokens and s.stop_ids
                for s in self._rows):
            return None
        return self._batch_sampling(self.runner.device).fused

    def _set_rows(self, rows: list[Sample]) -> None:
        self._rows = rows
        self._rows_sampling = None

    def _sample_into(self, samples: list[Sample], logits: torch.Tensor,
                     batch: BatchSampling) -> None:
        banned = {i: tuple(s.stop_ids) for i, s in enumerate(samples)
                  if len(s.output_ids) < s.request.params.min_new_tokens and s.stop_ids}
        tokens, logprobs = sample_next(logits, batch, self._generator, banned)
        self._append(samples, tokens.tolist(), logprobs.tolist())

    @staticmethod
    def _append(samples: list[Sample], tokens: list[int], logprobs: list[float]) -> None:
        """Add one drawn token per sample; finish samples on a stop token or their length."""
        for s, tok, lp in zip(samples, tokens, logprobs):
            if s.finish is not None:
                continue
            s.output_ids.append(tok)
            s.logprobs.append(lp)
            if tok in s.stop_ids:
                s.finish = {"type": "stop", "matched": tok}
            elif len(s.output_ids) >= s.max_new_tokens:
                s.finish = {"type": "length", "length": len(s.output_ids)}

    def _settle(self, compact: bool = False) -> None:
        """Deliver finished rows' results and drop them from the batch: at once on the native
        path (its paged cache moves table rows, not K/V; a finished row decoded on reads its
        whole context and takes pages), on the HF path once they are a quarter of it (copying
        its KV cache for every finished row would cost more than decoding them)."""
        dead = [s for s in self._rows if s.finish is not None]
        if not dead:
            return
        self._retire(dead)
        if compact or self.runner.native is not None or len(dead) * 4 >= len(self._rows):
            keep = [i for i, s in enumerate(self._rows) if s.finish is None]
            self.runner.keep_rows(keep)
            self._set_rows([self._rows[i] for i in keep])

    def _retire(self, samples: list[Sample]) -> None:
        """Stamp finished samples; resolve requests whose samples all finished."""
        for s in samples:
            if s.finish is not None and not s.weight_version:
                s.weight_version = self.weight_version
        for request in {id(s.request): s.request for s in samples}.values():
            if all(s.finish is not None for s in request.samples) and not request.future.done():
                request.future.set_result([self._result(s) for s in request.samples])

    def _result(self, s: Sample) -> SampleResult:
        req = s.request
        routes = None
        if req.return_routed_experts and s.route_chunks:
            fed = len(req.prompt_ids) + len(s.output_ids) - 1
            routes = torch.cat(s.route_chunks)[:fed][req.routed_experts_start_len:]
        return SampleResult(
            rid=s.rid, index=s.index, prompt_ids=req.prompt_ids, output_ids=s.output_ids,
            logprobs=s.logprobs if req.return_logprob else None, finish_reason=s.finish or {},
            weight_version=s.weight_version, routed_experts=routes,
            e2e_latency=time.monotonic() - req.created)

    def abort_requests(self, rid: str | None, message: str) -> int:
        """Finish the sample ``rid`` (None: all) as aborted, running or waiting (engine thread
        only; others use :meth:`abort`); returns how many samples."""
        hit: list[Sample] = []
        for unit in list(self._waiting):
            matched = [s for s in unit.samples if rid is None or s.rid == rid]
            if matched:
                unit.samples = [s for s in unit.samples if s not in matched]
                if not unit.samples:
                    self._waiting.remove(unit)
                hit.extend(matched)
        for s in self._rows:
            if s.finish is None and (rid is None or s.rid == rid):
                hit.append(s)
        for s in hit:
            s.finish = {"type": "abort", "message": message}
        self._settle()
        self._retire(hit)
        return len(hit)

    def _pause(self, mode: PauseMode) -> None:
        if mode == "abort":
            self.abort_requests(None, "aborted by pause_generation(mode=abort)")
        elif mode == "retract":
            self._settle(compact=True)
            retracted = [Prefill.retracted(s) for s in self._rows]
            self._set_rows([])
            self.runner.clear_rows()
            self._waiting.extendleft(reversed(retracted))
        elif mode != "in_place":
            raise ValueError(f"mode: {mode!r} must be one of abort, retract, in_place")
        self.paused = True

    def _resume(self) -> None:
        self.paused = False

    def _fail_all(self, err: Exception) -> None:
        requests = {id(s.request): s.request for s in self._rows}
        for unit in [*self._waiting, *self._prefilling]:
            requests.update({id(s.request): s.request for s in unit.samples})
        self._prefilling = []
        self._set_rows([])
        self._waiting = deque()
        self.runner.clear_rows()
        for request in requests.values():
            if not request.future.done():
                request.future.set_exception(err)
