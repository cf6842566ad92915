"""The HTTP calls a client makes to every engine of a set of SGLang-API servers, and the
engines' weight-update endpoints on top of them (:class:`EngineCalls`). Retries with backoff on
connection errors; an engine's error answer raises :class:`EngineError` with its message.
:class:`~megarl.rollout.sglang.client.SGLangClient` adds generation, engine failures and the
control calls."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import httpx

from megarl.rollout.interface import RolloutEngine

RETRYABLE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError,
             httpx.WriteError, httpx.ConnectTimeout, httpx.PoolTimeout)


class EngineError(RuntimeError):
    """An engine answered with an error or could not be reached (``url``: the engine's, when
    one engine's answer is meant)."""

    def __init__(self, message: str, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url


class EngineCalls(RolloutEngine):
    """Calls to every engine (or some) at once, over pooled HTTP connections; the weight
    updates."""

    urls: list[str]
    """The engines' base URLs."""
    ranks_per_engine: int
    """TP ranks of one engine (the weight-update group has one member per rank)."""
    max_retries: int
    retry_backoff_s: float
    _http: httpx.AsyncClient
    """The pool of the control and weight-update calls."""

    async def _request(self, method: str, url: str, body: Any = None, *, retry: bool = True,
                       http: httpx.AsyncClient | None = None) -> httpx.Response:
        attempts = self.max_retries + 1 if retry else 1
        for attempt in range(attempts):
            try:
                return await (http or self._http).request(method, url, json=body)
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
                              f"{error_message(response)}")
        return response.json() if response.content else None

    def _targets(self, engines: Sequence[int] | None) -> list[int]:
        return list(range(len(self.urls))) if engines is None else list(engines)

    async def _each(self, method: str, path: str, body: Any = None, *, retry: bool = False,
                    engines: Sequence[int] | None = None) -> list[Any]:
        """Call every engine (or ``engines``) at once; returns their answers in that order."""
        return list(await asyncio.gather(
            *(self._json(method, self.urls[i] + path, body, retry=retry)
              for i in self._targets(engines))))

    async def _each_outcome(self, path: str, bodies: Sequence[dict[str, Any]],
                            engines: Sequence[int] | None = None) -> list[str]:
        """POST a ``{"success", "message"}`` endpoint on every engine (or ``engines``, one body
        each); raise on any failure."""
        urls = [self.urls[i] for i in self._targets(engines)]
        responses = await asyncio.gather(
            *(self._request("POST", url + path, body, retry=False)
              for url, body in zip(urls, bodies)))
        messages = []
        for url, response in zip(urls, responses):
            data = json_object(response)
            if response.status_code >= 400 or not data.get("success", True):
                reason = data.get("message", error_message(response))
                raise EngineError(f"POST {url}{path} failed: {reason}", url=url)
            messages.append(str(data.get("message", "")))
        return messages

    async def init_weights_update_group(
        self, master_address: str, master_port: int, world_size: int,
        group_name: str = "weight_update_group", backend: str = "nccl",
    ) -> None:
        """Engine i's TP rank r joins as ``1 + i * ranks_per_engine + r`` (the engine adds r to
        its ``rank_offset``), so ``world_size`` must be ``1 + engines * ranks_per_engine``; the
        sender (rank 0) must join concurrently (this call returns once everyone has)."""
        expected = 1 + len(self.urls) * self.ranks_per_engine
        if world_size != expected:
            raise ValueError(f"world_size {world_size}: the sender plus {len(self.urls)} engines "
                             f"x {self.ranks_per_engine} ranks make {expected}")
        bodies = [{"master_address": master_address, "master_port": master_port,
                   "rank_offset": 1 + i * self.ranks_per_engine, "world_size": world_size,
                   "group_name": group_name, "backend": backend} for i in range(len(self.urls))]
        await self._each_outcome("/init_weights_update_group", bodies)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group", *,
                                           engines: Sequence[int] | None = None) -> None:
        """Every engine (or ``engines``: e.g. all but a restarted one) leaves the group."""
        targets = self._targets(engines)
        await self._each_outcome("/destroy_weights_update_group",
                                 [{"group_name": group_name}] * len(targets), targets)

    async def update_weights_from_distributed(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], *,
        group_name: str = "weight_update_group", weight_version: str | None = None,
        flush_cache: bool = True, abort_all_requests: bool = False,
        load_format: str | None = None,
    ) -> None:
        """Every engine receives one bucket while the sender broadcasts it (in this order);
        with ``load_format="flattened_bucket"`` the sender broadcasts the bucket's bytes as
        one uint8 tensor."""
        body = {"names": list(names), "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
                "shapes": [list(s) for s in shapes], "group_name": group_name,
                "flush_cache": flush_cache, "abort_all_requests": abort_all_requests,
                "load_format": load_format}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        await self._each_outcome("/update_weights_from_distributed", [body] * len(self.urls))

    async def update_weights_from_tensor(
        self, serialized_named_tensors: Sequence[Sequence[str]], *,
        load_format: str | None = None, weight_version: str | None = None,
        flush_cache: bool = True, engines: Sequence[int] | None = None,
    ) -> None:
        """Colocated update: ``serialized_named_tensors[i]`` is engine i's list of entries, one
        per engine TP rank (each engine reads the handles of its own GPUs; one body for all
        engines would hand every engine the first engine's memory)."""
        targets = self._targets(engines)
        if len(serialized_named_tensors) != len(targets):
            raise ValueError(f"serialized_named_tensors: {len(serialized_named_tensors)} lists "
                             f"for {len(targets)} engines; give one list per engine")
        bodies = []
        for entries in serialized_named_tensors:
            if isinstance(entries, str) or len(entries) != self.ranks_per_engine:
                raise ValueError(f"serialized_named_tensors: each engine needs a list of "
                                 f"{self.ranks_per_engine} entries (one per engine TP rank)")
            body: dict[str, Any] = {"serialized_named_tensors": list(entries),
                                    "load_format": load_format, "flush_cache": flush_cache}
            if weight_version is not None:
                body["weight_version"] = str(weight_version)
            bodies.append(body)
        await self._each_outcome("/update_weights_from_tensor", bodies, targets)

    async def load_lora_adapter_from_tensors(self, lora_name: str, config_dict: dict[str, Any],
                                             serialized_tensors: str,
                                             load_format: str | None = None) -> None:
        """Every engine loads adapter ``lora_name`` (PEFT's config and serialized tensors)."""
        body = {"lora_name": lora_name, "config_dict": config_dict,
                "serialized_tensors": serialized_tensors, "load_format": load_format}
        await self._each_lora("/load_lora_adapter_from_tensors", body)

    async def unload_lora_adapter(self, lora_name: str, *,
                                  engines: Sequence[int] | None = None) -> None:
        """Every engine (or ``engines``: e.g. all but a restarted one, which never had it)
        drops adapter ``lora_name``."""
        await self._each_lora("/unload_lora_adapter", {"lora_name": lora_name}, engines)

    async def _each_lora(self, path: str, body: dict[str, Any],
                         engines: Sequence[int] | None = None) -> None:
        """POST a LoRA endpoint (SGLang's ``LoRAUpdateOutput`` answer) on every engine (or
        ``engines``)."""
        urls = [self.urls[i] for i in self._targets(engines)]
        responses = await asyncio.gather(*(self._request("POST", url + path, body, retry=False)
                                           for url in urls))
        for url, response in zip(urls, responses):
            data = json_object(response)
            if response.status_code >= 400 or not data.get("success", True):
                reason = data.get("error_message") or error_message(response)
                raise EngineError(f"POST {url}{path} failed: {reason}", url=url)

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
                        str(data.get("message", error_message(r)))))
        return out


def json_object(response: httpx.Response) -> dict[str, Any]:
    """The JSON object of an answer; {} for an empty body, a JSON ``null`` (SGLang's success
    answer to ``/release_memory_occupation``) or anything else that is not an object."""
    try:
        data = response.json() if response.content else None
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def error_message(response: httpx.Response) -> str:
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
