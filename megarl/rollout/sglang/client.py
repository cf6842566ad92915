"""Async HTTP client for a set of SGLang-API servers (real SGLang or megarl's embedded engine).

One ``httpx.AsyncClient`` (pooled, kept-alive connections) serves all engines. Generation goes
through the load balancer (least outstanding tokens, sticky per prompt), with at most
``max_concurrency_per_engine`` requests in flight per engine. A prompt's ``n`` samples go as
``n`` requests of one sample each (sample j: ``sampling_seed`` seed + j, rid ``<rid>-<j>``; see
:meth:`SGLangClient.generate_one`), so they are distinct and reproducible on SGLang started with
``--enable-deterministic-inference``; aborting a prompt's rid aborts each of them, and a
cancelled ``generate`` aborts its requests on the engine. Control and
weight-update calls go to every engine at once (with a router, generation goes to the router and
control calls still go to the engines themselves). With ``api_key`` every request carries
``Authorization: Bearer <api_key>``.

Engine failures (see :mod:`megarl.rollout.recovery` for bringing engines back):

- a request whose connection fails is retried on the same engine while the engine still
  answers ``/health``; when it does not, the engine is marked *down* (``on_engine_down`` is
  called), every request in flight on it is cancelled there, and each is re-sent to another
  engine. ``/health`` checks (:meth:`SGLangClient.health`, :meth:`SGLangClient.monitor`) mark
  an engine down after ``unhealthy_after`` failures in a row, which catches hung engines.
  SGLang's ``/health`` is a one-token generation: while this client has paused generation on
  an engine (:meth:`SGLangClient.pause`) or released its memory, the check blocks and ends in
  a 503, so only a lost connection counts as a failure then (:meth:`SGLangClient.held`);
- a down engine takes no requests until :meth:`SGLangClient.readmit` checked that it serves the
  expected ``weight_version``; while every engine is down a request waits up to
  ``failover_timeout_s`` for one to be readmitted;
- with ``retry_aborted > 0`` a request that the *engine* aborted (a weight update with
  ``abort_all_requests``, ``pause_generation(mode=abort)``, a server shutting down) is sent again
  up to that many times, so the caller receives samples produced by one set of weights. Requests
  aborted through this client's :meth:`SGLangClient.abort` are returned as aborted.

The HTTP calls to every engine and the weight-update endpoints are
:class:`~megarl.rollout.sglang.engine_calls.EngineCalls`, which this client extends.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from megarl.memory import PhaseOutOfMemory, is_out_of_memory
from megarl.rollout.balancer import LoadBalancer, NoHealthyEngine
from megarl.rollout.interface import PauseMode, RolloutSample, SamplingParams
from megarl.rollout.routed_experts import RoutedExpertsLayout
from megarl.rollout.sglang.codec import decode_generate_answer, generate_payload
from megarl.rollout.sglang.engine_calls import (
    RETRYABLE,
    EngineCalls,
    EngineError,
    error_message,
    json_object,
)

logger = logging.getLogger(__name__)

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # what tags=null releases


class _EngineLost(Exception):
    """The engine running a request went down; the request goes to another engine."""


@dataclass
class AdapterRef:
    """The loaded LoRA adapter every ``/generate`` names (``actor.lora.sync: adapter``; None:
    the engines' own weights), shared by the trainer's client and the overlapping schedulers'
    own clients, so a sync's new name reaches every request."""

    name: str | None = None


@dataclass
class ClientStats:
    """What the client did to keep generation going (counters since it was created)."""

    requests: list[int] = field(default_factory=list)
    """``/generate`` requests sent, per engine."""
    engine_failures: int = 0
    """Times an engine was marked down."""
    failovers: int = 0
    """Requests re-sent to another engine because theirs went down."""
    resubmitted_aborts: int = 0
    """Requests the engine aborted that were sent again (``retry_aborted``)."""


class SGLangClient(EngineCalls):
    """:class:`RolloutEngine` over SGLang HTTP servers."""

    def __init__(
        self,
        engine_urls: Sequence[str],
        *,
        router_url: str | None = None,
        max_concurrency_per_engine: int = 256,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        timeout_s: float | None = None,
        routed_experts_layout: RoutedExpertsLayout | None = None,
        ranks_per_engine: int = 1,
        api_key: str | None = None,
        retry_aborted: int = 0,
        failover_timeout_s: float = 0.0,
        unhealthy_after: int = 3,
        health_timeout_s: float = 5.0,
        on_engine_down: Callable[[int, str], None] | None = None,
        adapter: AdapterRef | None = None,
    ) -> None:
        if not engine_urls:
            raise ValueError("engine_urls: give at least one engine URL")
        self.urls = [u.rstrip("/") for u in engine_urls]
        self.router_url = router_url.rstrip("/") if router_url else None
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.ranks_per_engine = ranks_per_engine
        self.retry_aborted = retry_aborted
        self.failover_timeout_s = failover_timeout_s
        self.unhealthy_after = unhealthy_after
        self.health_timeout_s = health_timeout_s
        self.on_engine_down = on_engine_down
        self.balancer = LoadBalancer(len(self.urls))
        self.adapter = adapter or AdapterRef()
        self.stats = ClientStats(requests=[0] * len(self.urls))
        self.max_concurrency_per_engine = max_concurrency_per_engine
        self._semaphores: list[asyncio.Semaphore] | None = None
        self._layouts: dict[int, RoutedExpertsLayout | None] = {}
        self._default_layout = routed_experts_layout
        self._rid_engine: dict[str, int] = {}
        self._children: dict[str, list[str]] = {}
        """The rids of the per-sample requests sent for a prompt's rid (n > 1)."""
        self._inflight: list[set[asyncio.Task]] = [set() for _ in self.urls]
        self._failed_checks = [0] * len(self.urls)
        self._paused: set[int] = set()
        self._released: list[set[str]] = [set() for _ in self.urls]
        self._aborted_rids: set[str] = set()
        self._abort_epoch = 0
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._http = _pooled(16 + 4 * len(self.urls), timeout_s, headers)
        # one pool per engine: httpx scans its whole pool on every request, so a shared pool
        # of N engines x max_concurrency connections would cost N times more per request
        self._generate_http = [_pooled(max_concurrency_per_engine + 4, timeout_s, headers)
                               for _ in range(1 if router_url else len(self.urls))]

    def live_engines(self) -> list[int]:
        """Engines not marked down."""
        return [i for i in range(len(self.urls)) if i not in self.balancer.down]

    # ----- generation -----
    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        rids: Sequence[str] | None = None,
        group_keys: Sequence[Hashable] | None = None,
        seeds: Sequence[int] | None = None,
    ) -> list[RolloutSample]:
        """Generate ``params.n`` samples per prompt, prompt-major; ``group_keys`` (default:
        the prompt's token ids) decide which requests share an engine; ``seeds`` give each
        prompt its own sampling seed (sample j of prompt i uses ``seeds[i] + j``), which makes
        the samples independent of how the engine batches requests (engines honour seeds only
        when started with ``--enable-deterministic-inference``)."""
        rids = list(rids) if rids is not None else [uuid.uuid4().hex for _ in prompts]
        if len(rids) != len(prompts):
            raise ValueError(f"rids: {len(rids)} ids for {len(prompts)} prompts")
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"seeds: {len(seeds)} seeds for {len(prompts)} prompts")
        groups = await asyncio.gather(*(
            self.generate_one(
                list(p), params if seeds is None else replace(params, seed=int(seeds[i])),
                rid=rids[i], prompt_index=i,
                group_key=group_keys[i] if group_keys is not None else None,
                return_logprob=return_logprob, return_routed_experts=return_routed_experts)
            for i, p in enumerate(prompts)))
        return [s for group in groups for s in group]

    async def generate_one(
        self, prompt_ids: list[int], params: SamplingParams, *, rid: str | None = None,
        prompt_index: int = 0, group_key: Hashable | None = None, return_logprob: bool = True,
        return_routed_experts: bool = False,
    ) -> list[RolloutSample]:
        """One prompt's ``n`` samples from one engine (another one if that engine fails), sent
        as one batched ``/generate`` of ``n`` single-sample items: sample j with
        ``sampling_seed`` ``seed + j`` (a random seed when ``params.seed`` is None) and rid
        ``f"{rid}-{j}"`` (``rid`` itself when n == 1). SGLang gives all samples of an n > 1
        request the same seed (identical samples under deterministic inference) and ids of its
        own, so n > 1 is never sent; a batch of equal-n items is what it accepts."""
        rid = rid or uuid.uuid4().hex
        children = [rid] if params.n == 1 else [f"{rid}-{j}" for j in range(params.n)]
        key = group_key if group_key is not None else tuple(prompt_ids)
        if params.n > 1:
            self._children[rid] = children
        try:
            items = [(child, replace(params, n=1, seed=seed))
                     for child, seed in zip(children, _sample_seeds(params))]
            return await self._generate_items(prompt_ids, items, key, prompt_index,
                                              return_logprob, return_routed_experts)
        finally:
            self._children.pop(rid, None)
            self._aborted_rids.discard(rid)

    async def _generate_items(
        self, prompt_ids: list[int], items: list[tuple[str, SamplingParams]], key: Hashable,
        prompt_index: int, return_logprob: bool, return_routed_experts: bool,
    ) -> list[RolloutSample]:
        """Single-sample requests ``(rid, params)`` of one prompt in one call (a batch when
        there are several), re-sent on engine loss; with ``retry_aborted`` the samples the
        engine aborted are sent again, the others kept."""
        samples: list[RolloutSample | None] = [None] * len(items)
        todo, lost, resubmits = list(range(len(items))), 0, 0
        try:
            while todo:
                rids = [items[j][0] for j in todo]
                payload = generate_payload(prompt_ids, [items[j][1] for j in todo], rids=rids,
                                           return_logprob=return_logprob,
                                           return_routed_experts=return_routed_experts)
                if self.lora_path is not None:  # the policy's LoRA adapter (adapter sync)
                    payload["lora_path"] = self.lora_path
                cost = (len(prompt_ids) + items[0][1].max_new_tokens) * len(todo)
                engine = await self._acquire(key, cost)
                epoch = self._abort_epoch
                try:
                    answer = await self._generate_on(engine, rids, payload)
                except _EngineLost:
                    lost += 1
                    self.stats.failovers += 1
                    if lost > len(self.urls) * (self.max_retries + 1):
                        raise EngineError(f"request {rids[0]}: its engine failed {lost} times; "
                                          "see the engine logs") from None
                    continue
                finally:
                    self.balancer.release(engine, cost)
                layout = await self._layout(engine) if return_routed_experts else None
                got = decode_generate_answer(answer, prompt_ids, prompt_index, layout)
                if len(got) != len(todo):
                    raise EngineError(f"request {rids[0]}: {len(got)} samples for "
                                      f"{len(todo)} single-sample requests")
                for j, sample in zip(todo, got):
                    samples[j] = replace(sample, sample_index=j)
                retry = [j for j in todo
                         if self._resubmit(samples[j], items[j][0], epoch, resubmits)]
                if retry:
                    resubmits += 1
                    self.stats.resubmitted_aborts += len(retry)
                todo = retry
        finally:
            self._aborted_rids.difference_update(rid for rid, _ in items)
        return [s for s in samples if s is not None]

    async def _acquire(self, key: Hashable, cost: int) -> int:
        """An engine for the request; waits up to ``failover_timeout_s`` while all are down."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.failover_timeout_s
        while True:
            try:
                return self.balancer.acquire(key, cost)
            except NoHealthyEngine as err:
                if loop.time() >= deadline:
                    raise EngineError(f"{err} (waited {self.failover_timeout_s:.0f} s for one to "
                                      "be readmitted)") from None
            await asyncio.sleep(0.1)

    @property
    def lora_path(self) -> str | None:
        """The adapter every ``/generate`` names (:class:`AdapterRef`)."""
        return self.adapter.name

    @lora_path.setter
    def lora_path(self, name: str | None) -> None:
        self.adapter.name = name

    async def _generate_on(self, engine: int, rids: list[str], payload: dict[str, Any]) -> Any:
        """POST ``/generate`` (the requests ``rids``) to ``engine``; :class:`_EngineLost` when
        it goes down meanwhile."""
        async with self._semaphore(engine):
            if engine in self.balancer.down:
                raise _EngineLost
            self._rid_engine.update(dict.fromkeys(rids, engine))
            self.stats.requests[engine] += 1
            call = asyncio.ensure_future(self._post_generate(engine, payload))
            self._inflight[engine].add(call)
            try:
                return await call
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if (task is not None and task.cancelling()) or engine not in self.balancer.down:
                    await asyncio.shield(asyncio.gather(*(self._abort_quietly(r) for r in rids)))
                    raise
                raise _EngineLost from None
            finally:
                self._inflight[engine].discard(call)
                for rid in rids:
                    self._rid_engine.pop(rid, None)

    async def _post_generate(self, engine: int, payload: dict[str, Any]) -> Any:
        """One ``/generate`` call. A failed connection is retried at once (a kept-alive
        connection the server had just closed), then up to ``max_retries`` times with backoff
        while the engine answers ``/health``; otherwise the engine is marked down and
        :class:`_EngineLost` raised. Behind a router, failures are the router's to handle."""
        if self.router_url is not None:
            response = await self._request("POST", self.router_url + "/generate", payload,
                                           http=self._generate_http[0])
        else:
            response = await self._post_to_engine(engine, payload)
        if response.status_code >= 400:
            raise EngineError(f"POST {response.request.url} -> HTTP {response.status_code}: "
                              f"{error_message(response)}")
        return response.json()

    async def _post_to_engine(self, engine: int, payload: dict[str, Any]) -> httpx.Response:
        url, http = self.urls[engine], self._generate_http[engine]
        attempts = self.max_retries + 2
        for attempt in range(attempts):
            try:
                return await http.post(url + "/generate", json=payload)
            except RETRYABLE as err:
                if attempt == 0:
                    continue
                reason = f"{type(err).__name__}: {err or 'connection lost'}"
                if attempt == attempts - 1 or not await self._probe(engine):
                    self.mark_down(engine, f"/generate failed ({reason}) and /health does not "
                                           "answer")
                    raise _EngineLost from None
                await asyncio.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
        raise AssertionError("unreachable")

    def _resubmit(self, sample: RolloutSample, rid: str, epoch: int, resubmits: int) -> bool:
        """Whether a sample the engine aborted should be generated again."""
        return (resubmits < self.retry_aborted and sample.finish_reason == "abort"
                and rid not in self._aborted_rids and epoch == self._abort_epoch)

    def _semaphore(self, engine: int) -> asyncio.Semaphore:
        if self._semaphores is None:
            self._semaphores = [asyncio.Semaphore(self.max_concurrency_per_engine) for _ in self.urls]
        return self._semaphores[engine]

    async def _layout(self, engine: int) -> RoutedExpertsLayout | None:
        """Where the MoE layers sit in ``routed_experts``: given, or read from the config.json
        of the ``model_path`` the engine reports in ``/model_info`` (when this machine sees
        that directory; SGLang's ``/model_info`` has no MoE fields)."""
        if self._default_layout is not None:
            return self._default_layout
        if engine not in self._layouts:
            path = Path(str((await self._model_info(engine)).get("model_path") or ""))
            found = (path / "config.json").is_file()
            self._layouts[engine] = RoutedExpertsLayout.from_model_path(path) if found else None
        return self._layouts[engine]

    async def _model_info(self, engine: int) -> dict[str, Any]:
        """``/model_info`` of ``engine`` (``/get_model_info`` on SGLang versions before it)."""
        response = await self._request("GET", self.urls[engine] + "/model_info")
        if response.status_code == 404:
            response = await self._request("GET", self.urls[engine] + "/get_model_info")
        if response.status_code >= 400:
            raise EngineError(f"GET {response.request.url} -> HTTP {response.status_code}: "
                              f"{error_message(response)}")
        return json_object(response)

    async def _abort_quietly(self, rid: str) -> None:
        try:
            await self.abort(rid)
        except EngineError as err:
            logger.warning("could not abort %s: %s", rid, err)

    # ----- engine failures -----
    @property
    def down(self) -> dict[int, str]:
        """Engines marked down (taking no requests until :meth:`readmit`), with the reason."""
        return dict(self.balancer.down)

    def mark_down(self, engine: int, reason: str) -> None:
        """Take ``engine`` out of service: its requests in flight go to other engines."""
        if not self.balancer.mark_down(engine, reason):
            return
        self.stats.engine_failures += 1
        logger.warning("rollout engine %d (%s) is down: %s; its %d requests in flight go to the "
                       "other engines", engine, self.urls[engine], reason,
                       len(self._inflight[engine]))
        for call in list(self._inflight[engine]):
            call.cancel()
        if self.on_engine_down is not None:
            self.on_engine_down(engine, reason)

    async def readmit(self, engine: int, weight_version: str | None) -> None:
        """Put a recovered engine back into service once it serves ``weight_version`` (not
        checked when None); raise :class:`EngineError` if it serves another."""
        served = (await self._model_info(engine)).get("weight_version")
        if weight_version is not None and str(served) != str(weight_version):
            raise EngineError(f"engine {engine} ({self.urls[engine]}) serves weight_version "
                              f"{served!r}, expected {weight_version!r}; push the current "
                              "weights to it before readmitting it")
        self._layouts.pop(engine, None)
        self._failed_checks[engine] = 0
        self._paused.discard(engine)  # a restarted engine is neither paused nor released
        self._released[engine].clear()
        self.balancer.readmit(engine)
        logger.warning("rollout engine %d (%s) is back at weight_version %r", engine,
                       self.urls[engine], served)

    def held(self, engine: int) -> bool:
        """Whether this client paused generation on ``engine`` or released its memory: SGLang
        then holds ``/health`` (a one-token generation) and answers 503 after ~20 s."""
        return engine in self._paused or bool(self._released[engine])

    async def _probe(self, engine: int) -> bool:
        """Whether the engine answers ``/health`` with 200 within ``health_timeout_s``; while
        :meth:`held`, a timeout or a 503 counts as alive (only a lost connection does not)."""
        try:
            response = await self._http.get(self.urls[engine] + "/health",
                                            timeout=self.health_timeout_s)
        except httpx.TimeoutException:
            return self.held(engine)
        except httpx.HTTPError:
            return False
        return response.status_code == 200 or (self.held(engine)
                                               and response.status_code == 503)

    async def health(self) -> list[bool]:
        """``/health`` of every engine (False when unreachable); an engine that fails
        ``unhealthy_after`` checks in a row is marked down."""
        states = list(await asyncio.gather(*(self._probe(i) for i in range(len(self.urls)))))
        for i, ok in enumerate(states):
            self.balancer.set_healthy(i, ok)
            self._failed_checks[i] = 0 if ok else self._failed_checks[i] + 1
            if self._failed_checks[i] >= self.unhealthy_after:
                self.mark_down(i, f"failed {self._failed_checks[i]} health checks in a row")
        return states

    async def monitor(self, interval_s: float = 5.0) -> None:
        """Check every engine's health every ``interval_s`` until cancelled (run it as a task
        next to generation to catch engines that hang rather than die)."""
        while True:
            await self.health()
            await asyncio.sleep(interval_s)

    async def wait_ready(self, timeout_s: float = 600.0, poll_s: float = 0.5) -> None:
        """Wait until every engine answers ``/health`` with 200."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            states = list(await asyncio.gather(*(self._probe(i) for i in range(len(self.urls)))))
            if all(states):
                return
            if asyncio.get_running_loop().time() > deadline:
                down = [u for u, ok in zip(self.urls, states) if not ok]
                raise EngineError(f"engines not ready after {timeout_s:.0f} s: {down}")
            await asyncio.sleep(poll_s)

    # ----- control -----
    async def abort(self, rid: str | None = None) -> None:
        """Abort one prompt's requests (``rid`` as given to :meth:`generate_one`: each of its
        samples' requests, on the engine running it) or every request on every engine;
        aborted requests are returned as aborted, never re-sent."""
        if rid is None:
            self._abort_epoch += 1
            await self._each("POST", "/abort_request", {"rid": "", "abort_all": True},
                             retry=True, engines=self.live_engines())
            return
        targets = self._children.get(rid, [rid])
        self._aborted_rids.update([rid, *targets])
        calls = []
        for target in targets:
            engine = self._rid_engine.get(target)
            engines = [engine] if engine is not None else self.live_engines()
            calls.append(self._each("POST", "/abort_request", {"rid": target}, retry=True,
                                    engines=engines))
        await asyncio.gather(*calls)

    async def pause(self, mode: PauseMode = "retract") -> None:
        """``/pause_generation`` on every engine that is not down."""
        engines = self.live_engines()
        self._paused.update(engines)  # before the call: health checks may run meanwhile
        await self._each("POST", "/pause_generation", {"mode": mode}, engines=engines)

    async def resume(self) -> None:
        """``/continue_generation`` on every engine that is not down."""
        engines = self.live_engines()
        await self._each("POST", "/continue_generation", {}, engines=engines)
        self._paused.difference_update(engines)

    async def flush_cache(self) -> list[bool]:
        """``/flush_cache`` on every engine; False where requests were pending."""
        responses = await asyncio.gather(
            *(self._request("POST", u + "/flush_cache", retry=False) for u in self.urls))
        return [r.status_code == 200 for r in responses]

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """``/release_memory_occupation`` on every engine."""
        body = {"tags": list(tags) if tags is not None else None}
        for released in self._released:
            released.update(tags if tags is not None else MEMORY_TAGS)
        await self._each_outcome("/release_memory_occupation", [body] * len(self.urls))

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """``/resume_memory_occupation`` on every engine. An engine that answers that it ran
        out of memory raises :class:`~megarl.memory.PhaseOutOfMemory` of phase
        ``resume_rollout``, with the engine's reason and the knobs (PITFALLS T1)."""
        body = {"tags": list(tags) if tags is not None else None}
        try:
            await self._each_outcome("/resume_memory_occupation", [body] * len(self.urls))
        except EngineError as err:
            if not is_out_of_memory(err):
                raise
            detail = " ".join(str(err).split(" failed: ", 1)[-1].split())
            raise PhaseOutOfMemory("resume_rollout", f"rollout engine {err.url}",
                                   detail) from err
        for released in self._released:
            released.difference_update(tags if tags is not None else MEMORY_TAGS)

    async def get_weight_version(self) -> list[str | None]:
        """Each engine's ``weight_version`` (from ``/model_info``)."""
        infos = await asyncio.gather(*(self._model_info(i) for i in range(len(self.urls))))
        return [info.get("weight_version") for info in infos]

    async def update_weight_version(self, new_version: str,
                                    abort_all_requests: bool = False) -> None:
        """Set the weight version string on every engine without touching weights."""
        body = {"new_version": str(new_version), "abort_all_requests": abort_all_requests}
        await self._each_outcome("/update_weight_version", [body] * len(self.urls))

    async def close(self) -> None:
        """Close pooled connections."""
        for http in (self._http, *self._generate_http):
            await http.aclose()


def _sample_seeds(params: SamplingParams) -> list[int | None]:
    """``sampling_seed`` of each of the ``n`` samples: ``seed + j``; for an unseeded sampled
    prompt fresh random seeds (an engine with deterministic inference would otherwise give
    every unseeded request the same default seed), none for greedy decoding."""
    if params.seed is not None:
        return [params.seed + j for j in range(params.n)]
    if params.greedy:
        return [None] * params.n
    return [secrets.randbelow(1 << 62) for _ in range(params.n)]


def _pooled(connections: int, timeout_s: float | None,
            headers: dict[str, str] | None) -> httpx.AsyncClient:
    """An HTTP client keeping up to ``connections`` connections alive; idle ones are dropped
    after 2 s, before a server closes them (uvicorn does after 5 s), so a request rarely meets
    a connection the server is closing. Engines are reached directly: an ``HTTP_PROXY`` of the
    user's environment is not used (PITFALLS M5)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=10.0), headers=headers, trust_env=False,
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections,
                            keepalive_expiry=2.0))


