"""SGLang's LoRA endpoints on the embedded server (``--enable-lora``; lora_serving.py).

``POST /load_lora_adapter`` ``{lora_name, lora_path, pinned}`` reads a PEFT directory;
``POST /load_lora_adapter_from_tensors`` ``{lora_name, config_dict, serialized_tensors,
load_format, pinned}`` takes PEFT's config and a serialized ``{name: tensor}`` (or a
``flattened_bucket``); ``POST /unload_lora_adapter`` ``{lora_name}``. Each answers SGLang's
``LoRAUpdateOutput`` ``{success, error_message, loaded_adapters}``, 200 or 400
(``sglang/srt/entrypoints/http_server.py``, ``managers/io_struct.py``). Loading and unloading
run on the engine thread, between generation steps.
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from megarl.rollout.local.engine import LocalEngine
from megarl.rollout.local.lora_serving import AdapterError, LoraServing, read_peft_dir
from megarl.weights.flattened import FLATTENED_BUCKET, deserialize, unflatten

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
"""SGLang's answer when the server was started without ``--enable-lora``."""


def _answer(lora: LoraServing | None, error: str | None) -> JSONResponse:
    loaded = {} if lora is None else {name: {"lora_name": name, "lora_path": path}
                                      for name, path in lora.loaded().items()}
    return JSONResponse({"success": error is None, "error_message": error,
                         "loaded_adapters": loaded}, status_code=400 if error else 200)


def _tensors(body: dict[str, Any]) -> dict[str, Any]:
    """The ``{name: tensor}`` of a ``/load_lora_adapter_from_tensors`` body."""
    data = body.get("serialized_tensors")
    if not isinstance(data, str):
        raise AdapterError("serialized_tensors: required, a serialized {name: tensor} string")
    try:
        payload = deserialize(data)
    except (ValueError, TypeError, pickle.UnpicklingError) as err:
        raise AdapterError(f"serialized_tensors could not be read: {err}") from None
    if body.get("load_format") == FLATTENED_BUCKET:
        return dict(unflatten(payload))
    if not isinstance(payload, dict):
        raise AdapterError("serialized_tensors: expected a serialized {name: tensor} dict")
    return payload


def add_lora_routes(app: FastAPI, engine: LocalEngine, body_of: Callable[..., Any]) -> None:
    """The three LoRA endpoints on ``app`` (``body_of``: the server's JSON body reader)."""

    async def on_engine(fn: Callable[[LoraServing], None]) -> JSONResponse:
        lora = engine.runner.lora
        if lora is None:
            return _answer(None, NOT_ENABLED)
        try:
            await asyncio.wrap_future(engine.call(lambda: fn(lora)))
        except AdapterError as err:
            return _answer(lora, str(err))
        return _answer(lora, None)

    def name_of(body: dict[str, Any]) -> str:
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise AdapterError("lora_name: required, a non-empty string")
        return name

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        body = await body_of(request)

        def load(lora: LoraServing) -> None:
            path = body.get("lora_path")
            if not isinstance(path, str):
                raise AdapterError("lora_path: required, a PEFT adapter directory")
            config, tensors = read_peft_dir(path)
            lora.load(name_of(body), config, tensors, path)

        return await on_engine(load)

    @app.post("/load_lora_adapter_from_tensors")
    async def load_lora_adapter_from_tensors(request: Request) -> JSONResponse:
        body = await body_of(request)

        def load(lora: LoraServing) -> None:
            config = body.get("config_dict")
            if not isinstance(config, dict):
                raise AdapterError("config_dict: required, the adapter's adapter_config.json")
            lora.load(name_of(body), config, _tensors(body))

        return await on_engine(load)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        body = await body_of(request)

        def unload(lora: LoraServing) -> None:
            name = name_of(body)
            users = engine.requests_using(name)
            if users:
                raise AdapterError(f"LoRA adapter {name!r} is in use by {users} request(s); "
                                   "unload it when they finish (or abort them)")
            lora.unload(name)

        return await on_engine(unload)
