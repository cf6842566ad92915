"""Async HTTP client for a set of SGLang-API servers (real SGLang or megarl's embedded engine).

One ``httpx.AsyncClient`` (pooled, kept-alive connections) serves all engines. Generation goes
through the load balancer (least outstanding tokens, sticky per prompt), with at most
``max_concurrency_per_engine`` requests in flight per engine, retries with backoff when the
connection fails (an engine restarting), and a request id per prompt so it can be aborted; a
cancelled ``generate`` aborts its requests on the engine. Control and weight-update calls go to
every engine at once (with a router, generation goes to the router and control calls still go to
the engines themselves).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any

import httpx

from megarl.rollout.balancer import LoadBalancer
from megarl.rollout.interface import PauseMode, RolloutEngine, RolloutSample, SamplingParams
from megarl.rollout.sglang.codec import decode_generate_answer, generate_payload

logger = logging.getLogger(__name__)

RETRYABLE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError,
             httpx.WriteError, httpx.ConnectTimeout, httpx.PoolTimeout)


class EngineError(RuntimeError):
    """An engine answered with an error or could not be reached."""


class SGLangClient(RolloutEngine):
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
        routed_experts_layout: tuple[int, int] | None = None,
        ranks_per_engine: int = 1,
    ) -> None:
        if not engine_urls:
            raise ValueError("engine_urls: give at least one engine URL")
        self.urls = [u.rstrip("/") for u in engine_urls]
        self.router_url = router_url.rstrip("/") if router_url else None
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.ranks_per_engine = ranks_per_engine
        self.balancer = LoadBalancer(len(self.urls))
        self._limit = max_concurrency_per_engine
        self._semaphores: list[asyncio.Semaphore] | None = None
        self._layouts: dict[int, tuple[int, int] | None] = {}
        self._default_layout = routed_experts_layout
        self._rid_engine: dict[str, int] = {}
        connections = max_concurrency_per_engine * len(self.urls) + 16
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=connections,
                                max_keepalive_connections=connections))

    # ----- HTTP plumbing -----
    async def _request(self, method: str, url: str, body: Any = None, *,
                       retry: bool = True) -> httpx.Response:
        attempts = self.max_retries + 1 if retry else 1
        for attempt in range(attempts):
            try:
                return await self._http.request(method, url, json=body)
            except RETRYABLE as err:
                if attempt + 1 == attempts:
                    raise EngineError(f"{method} {url} failed after {attempts} attempts: "
                                      f"{type(err).__name__}: {err}") from err
                await asyncio.sleep(self.retry_backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    async def _json(self, method: str, url: str, body: Any = None, *,
                    retry: bool = True) -> Any:
        response = await self._request(method, url, body, retry=retry)
        if response.status_code >= 400:
            raise EngineError(f"{method} {url} -> HTTP {response.status_code}: "
                              f"{_message(response)}")
        return response.json() if response.content else None

    async def _each(self, method: str, path: str, body: Any = None, *,
                    retry: bool = False) -> list[Any]:
        """Call every engine at once; returns their answers in engine order."""
        return list(await asyncio.gather(
            *(self._json(method, url + path, body, retry=retry) for url in self.urls)))

    async def _each_outcome(self, path: str, bodies: Sequence[dict[str, Any]]) -> list[str]:
        """POST a ``{"success", "message"}`` endpoint on every engine; raise on any failure."""
        responses = await asyncio.gather(
            *(self._request("POST", url + path, body, retry=False)
              for url, body in zip(self.urls, bodies)))
        messages = []
        for url, response in zip(self.urls, responses):
            data = response.json() if response.content else {}
            if response.status_code >= 400 or not data.get("success", True):
                reason = data.get("message", _message(response))
                raise EngineError(f"POST {url}{path} failed: {reason}")
            messages.append(str(data.get("message", "")))
        return messages

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
        the samples independent of how the engine batches requests."""
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
        """One prompt's ``n`` samples from one engine."""
        rid = rid or uuid.uuid4().hex
        payload = generate_payload(prompt_ids, params, rid=rid, return_logprob=return_logprob,
                                   return_routed_experts=return_routed_experts)
        cost = (len(prompt_ids) + params.max_new_tokens) * params.n
        key = group_key if group_key is not None else tuple(prompt_ids)
        engine = self.balancer.acquire(key, cost)
        url = self.router_url or self.urls[engine]
        self._rid_engine[rid] = engine
        try:
            async with self._semaphore(engine):
                answer = await self._json("POST", url + "/generate", payload)
        except asyncio.CancelledError:
            await asyncio.shield(self._abort_quietly(rid))
            raise
        finally:
            self.balancer.release(engine, cost)
            self._rid_engine.pop(rid, None)
        layout = await self._layout(engine) if return_routed_experts else None
        return decode_generate_answer(answer, prompt_ids, prompt_index, layout)

    def _semaphore(self, engine: int) -> asyncio.Semaphore:
        if self._semaphores is None:
            self._semaphores = [asyncio.Semaphore(self._limit) for _ in self.urls]
        return self._semaphores[engine]

    async def _layout(self, engine: int) -> tuple[int, int] | None:
        """(moe_layers, top_k) of routed experts: given, or read from ``/get_model_info``."""
        if self._default_layout is not None:
            return self._default_layout
        if engine not in self._layouts:
            info = await self._json("GET", self.urls[engine] + "/get_model_info")
            layers, top_k = info.get("num_moe_layers"), info.get("moe_top_k")
            self._layouts[engine] = (int(layers), int(top_k)) if layers and top_k else None
        return self._layouts[engine]

    async def _abort_quietly(self, rid: str) -> None:
        try:
            await self.abort(rid)
        except EngineError as err:
            logger.warning("could not abort %s: %s", rid, err)

    # ----- control -----
    async def abort(self, rid: str | None = None) -> None:
        """Abort one request (on the engine running it) or every request on every engine."""
        body = {"rid": rid} if rid is not None else {"rid": "", "abort_all": True}
        engine = self._rid_engine.get(rid) if rid is not None else None
        urls = [self.urls[engine]] if engine is not None else self.urls
        await asyncio.gather(*(self._json("POST", u + "/abort_request", body) for u in urls))

    async def pause(self, mode: PauseMode = "retract") -> None:
        """``/pause_generation`` on every engine."""
        await self._each("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        """``/continue_generation`` on every engine."""
        await self._each("POST", "/continue_generation", {})

    async def flush_cache(self) -> list[bool]:
        """``/flush_cache`` on every engine; False where requests were pending."""
        responses = await asyncio.gather(
            *(self._request("POST", u + "/flush_cache", retry=False) for u in self.urls))
        return [r.status_code == 200 for r in responses]

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """``/release_memory_occupation`` on every engine."""
        body = {"tags": list(tags) if tags is not None else None}
        await self._each_outcome("/release_memory_occupation", [body] * len(self.urls))

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """``/resume_memory_occupation`` on every engine."""
        body = {"tags": list(tags) if tags is not None else None}
        await self._each_outcome("/resume_memory_occupation", [body] * len(self.urls))

    async def health(self) -> list[bool]:
        """``/health`` of every engine (False when unreachable)."""
        async def one(url: str) -> bool:
            try:
                return (await self._http.get(url + "/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                return False

        states = list(await asyncio.gather(*(one(u) for u in self.urls)))
        for i, ok in enumerate(states):
            self.balancer.set_healthy(i, ok)
        return states

    async def wait_ready(self, timeout_s: float = 600.0, poll_s: float = 0.5) -> None:
        """Wait until every engine answers ``/health`` with 200."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not all(states := await self.health()):
            if asyncio.get_running_loop().time() > deadline:
                down = [u for u, ok in zip(self.urls, states) if not ok]
                raise EngineError(f"engines not ready after {timeout_s:.0f} s: {down}")
            await asyncio.sleep(poll_s)

    async def get_weight_version(self) -> list[str | None]:
        """Each engine's ``weight_version``."""
        infos = await self._each("GET", "/get_model_info", retry=True)
        return [info.get("weight_version") for info in infos]

    async def update_weight_version(self, new_version: str,
                                    abort_all_requests: bool = False) -> None:
        """Set the weight version string on every engine without touching weights."""
        body = {"new_version": str(new_version), "abort_all_requests": abort_all_requests}
        await self._each_outcome("/update_weight_version", [body] * len(self.urls))

    async def close(self) -> None:
        """Close pooled connections."""
        await self._http.aclose()

    # ----- weights -----
    async def init_weights_update_group(
        self, master_address: str, master_port: int, world_size: int,
        group_name: str = "weight_update_group", backend: str = "nccl",
    ) -> None:
        """Engine i joins as ranks ``1 + i * ranks_per_engine ...``; the sender (rank 0) must
        join concurrently (this call returns once everyone has)."""
        bodies = [{"master_address": master_address, "master_port": master_port,
                   "rank_offset": 1 + i * self.ranks_per_engine, "world_size": world_size,
                   "group_name": group_name, "backend": backend} for i in range(len(self.urls))]
        await self._each_outcome("/init_weights_update_group", bodies)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        """Every engine leaves the group."""
        await self._each_outcome("/destroy_weights_update_group",
                                 [{"group_name": group_name}] * len(self.urls))

    async def update_weights_from_distributed(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], *,
        group_name: str = "weight_update_group", weight_version: str | None = None,
        flush_cache: bool = True, abort_all_requests: bool = False,
    ) -> None:
        """Every engine receives one bucket while the sender broadcasts it (in this order)."""
        body = {"names": list(names), "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
                "shapes": [list(s) for s in shapes], "group_name": group_name,
                "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        await self._each_outcome("/update_weights_from_distributed", [body] * len(self.urls))

    async def update_weights_from_tensor(
        self, serialized_named_tensors: Sequence[str], *, load_format: str | None = None,
        weight_version: str | None = None, flush_cache: bool = True,
    ) -> None:
        """Colocated update: one serialized payload per TP rank, sent to every engine."""
        body: dict[str, Any] = {"serialized_named_tensors": list(serialized_named_tensors),
                                "load_format": load_format, "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        await self._each_outcome("/update_weights_from_tensor", [body] * len(self.urls))

    async def update_weights_from_disk(
        self, model_path: str, *, weight_version: str | None = None,
    ) -> None:
        """Every engine reloads its weights from an HF directory."""
        body: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        await self._each_outcome("/update_weights_from_disk", [body] * len(self.urls))

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """Each engine's first ``truncate_size`` rows of the weight ``name``."""
        return await self._each("POST", "/get_weights_by_name",
                                {"name": name, "truncate_size": truncate_size})

    async def check_weights(self, action: str) -> list[tuple[bool, str]]:
        """``/weights_checker`` (snapshot | reset_tensors | compare) on every engine."""
        responses = await asyncio.gather(
            *(self._request("POST", u + "/weights_checker", {"action": action}, retry=False)
              for u in self.urls))
        out = []
        for r in responses:
            data = r.json() if r.content else {}
            out.append((bool(data.get("success")) and r.status_code == 200,
                        str(data.get("message", _message(r)))))
        return out


def _message(response: httpx.Response) -> str:
    """The error text of an engine answer (SGLang puts it under ``message`` or ``error``)."""
    try:
        data = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict):
            return str(error.get("message", error))
        return str(data.get("message", error or data))
    return str(data)[:500]
