"""HTTP server of the embedded engine: the subset of SGLang's API that RL trainers use.

``python -m megarl.rollout.local.server --model PATH --host 127.0.0.1 --port P`` (also
``megarl serve``). Request and response shapes are SGLang's (see
shared/reference/SGLANG_API.md), so megarl's SGLang client drives this server and real SGLang
servers alike. Errors are answered as SGLang does, and the server keeps serving: a request
SGLang would reject while validating its body (malformed JSON, a missing field) gets 400
``{"object": "error", "message", "type", "param", "code"}``; one it rejects while running it
(``/generate`` input, ``/release_memory_occupation`` ...) gets 400 ``{"error": {"message"}}``.
A ``/resume_memory_occupation`` that runs out of device memory gets 500 with the same body,
whose message says why: out of memory, the bytes asked, the bytes free on the device and the
processes holding the rest (real SGLang's scheduler dies instead, and only its log says why).
``POST /megarl/weights`` hosts megarl's checkpoint engine (:mod:`~.checkpoint_engine`).

Security: ``/update_weights_from_tensor`` unpickles its payload, as SGLang does (and the ``ipc``
transport maps shared memory named by the caller), so the port must not face untrusted clients.
The server binds 127.0.0.1 unless ``--host`` says otherwise. With an API key (the environment
variable ``MEGARL_ROLLOUT_API_KEY``, from ``rollout.api_key``) every endpoint, health and
weight updates included, requires ``Authorization: Bearer <key>`` and answers 401 without it;
a non-loopback ``--host`` without a key is refused at start. The key is never logged, never
on the command line and never in ``/get_server_info``.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from megarl.config.model_info import weight_files
from megarl.memory import GB, device_memory_report, is_out_of_memory, settle_long_lived_objects
from megarl.rollout.interface import SamplingParams
from megarl.rollout.local.checkpoint_engine import CheckpointEndpoint
from megarl.rollout.local.engine import MEMORY_TAGS, OOM_RETRIES, LocalEngine
from megarl.rollout.local.engine import Request as EngineRequest
from megarl.rollout.local.kv_cache import kv_slots
from megarl.rollout.local.launch import API_KEY_ENV, is_loopback_host
from megarl.rollout.local.lora_endpoints import NOT_ENABLED, add_lora_routes
from megarl.rollout.local.lora_serving import AdapterError
from megarl.rollout.local.model_runner import LOAD_FORMATS, ModelRunner
from megarl.rollout.local.protocol import (
    BadRequest,
    Limits,
    NormalizeError,
    parse_generate,
    sample_to_sglang,
)
from megarl.rollout.local.weight_updates import WeightReceiver
from megarl.rollout.local.weights import unusable_weights
from megarl.rollout.routed_experts import RoutedExpertsLayout

logger = logging.getLogger(__name__)
DEFAULT_MEM_FRACTION = 0.8
"""--mem-fraction-static when not given (rollout.gpu_memory_utilization's default)."""


class InvalidBody(BadRequest):
    """A body SGLang's request validation would refuse (its ``ErrorResponse`` shape)."""


def _error(message: str, status: int = 400) -> JSONResponse:
    """SGLang's validation-error answer."""
    return JSONResponse({"object": "error", "message": message, "type": "Bad Request",
                         "param": None, "code": status}, status_code=status)


def _failure(message: str) -> JSONResponse:
    """SGLang's answer to a request that failed while it ran (``_create_error_response``)."""
    return JSONResponse({"error": {"message": message}}, status_code=400)


def _generation_failed(engine: LocalEngine, err: BaseException) -> JSONResponse:
    """The answer to requests a generation step failed: 500 with SGLang's error body, naming
    the error (and, out of memory, what the device has free and who holds the rest)."""
    reason = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
    if isinstance(err, torch.OutOfMemoryError):
        free, total, holders = device_memory_report(engine.runner.device)
        reason += (f"; {free} bytes ({free / GB:.2f} GB) free of {total} on "
                   f"{engine.runner.device}; held by: {holders}; the engine retried {OOM_RETRIES} "
                   "times with smaller budgets (lower rollout.gpu_memory_utilization, i.e. "
                   "--mem-fraction-static)")
    message = f"generation failed: {reason}"
    logger.error("/generate: %s", message)
    return JSONResponse({"error": {"message": message}}, status_code=500)


def _resume_out_of_memory(engine: LocalEngine, tags: list[str], err: BaseException) -> JSONResponse:
    """The answer to a resume that found no room on the device: 500, SGLang's error body, and
    a one-line message with the bytes asked, the bytes free and who holds the rest."""
    asked = engine.runner.weight_bytes() if "weights" in tags else 0
    free, total, holders = device_memory_report(engine.runner.device)
    reason = " ".join(str(err).split())[:300]
    message = (f"out of memory resuming {sorted(tags)}: asked {asked} bytes ({asked / GB:.2f} "
               f"GB), {free} bytes ({free / GB:.2f} GB) free of {total} on "
               f"{engine.runner.device}; held by: {holders}; {type(err).__name__}: {reason}")
    logger.error("/resume_memory_occupation: %s", message)
    return JSONResponse({"error": {"message": message}}, status_code=500)


def _outcome(success: bool, message: str) -> JSONResponse:
    return JSONResponse({"success": success, "message": message},
                        status_code=200 if success else 400)


async def _body(request: Request, required: bool = True) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        if required:
            raise InvalidBody("the request body is empty; send a JSON object")
        return {}
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as err:
        raise InvalidBody(f"malformed JSON body: {err}") from None
    if not isinstance(body, dict):
        raise InvalidBody("the request body must be a JSON object")
    return body


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in body:
        raise InvalidBody(f"{name}: required field is missing")
    if not isinstance(body[name], kind):
        raise InvalidBody(f"{name}: expected {getattr(kind, '__name__', kind)}")
    return body[name]


@dataclass
class ServerState:
    """What the endpoints share."""

    engine: LocalEngine
    receiver: WeightReceiver
    tokenizer: Any
    limits: Limits
    model_path: str
    args: dict[str, Any]
    checkpoint: CheckpointEndpoint
    """megarl's checkpoint-engine protocol (``POST /megarl/weights``)."""
    api_key: str | None = field(default=None, repr=False)
    """Key every request must carry (``Authorization: Bearer``); None = no check."""
    routes_layout: RoutedExpertsLayout | None = None
    """Where the MoE layers sit among all layers (``routed_experts`` has a row per layer)."""
    health_check_timeout_s: float = 20.0
    """How long ``/health`` waits for its one-token generation before answering 503."""


class ApiKeyGuard:
    """ASGI middleware: answer 401 to any HTTP request without ``Authorization: Bearer <key>``."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Check the header, then hand the request on (or refuse it)."""
        if scope["type"] == "http":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                refusal = _error("missing or wrong API key: send the header 'Authorization: "
                                 "Bearer <rollout.api_key>'", 401)
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


def load_tokenizer(model_path: str, trust_remote_code: bool = False) -> Any:
    """The model directory's tokenizer, or None when it has none (token ids only)."""
    path = Path(model_path)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                             "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        logger.warning("no usable tokenizer in %s (%s); serving token ids only", model_path, err)
        return None


def _check_adapters(engine: LocalEngine, names: list[str | None]) -> None:
    """Refuse (400) a request naming a LoRA adapter the engine does not hold."""
    if all(n is None for n in names):
        return
    if engine.runner.lora is None:
        raise BadRequest(f"lora_path: {NOT_ENABLED}")
    try:
        engine.runner.lora.check(names)
    except AdapterError as err:
        raise BadRequest(str(err)) from None


def _generation_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        requests, as_list = parse_generate(await _body(request), state.limits, state.tokenizer)
        _check_adapters(engine, [r.lora for r in requests])
        if "weights" in engine.released or engine.runner.weight_map.unwritten():
            raise BadRequest(unusable_weights(engine.released, engine.runner.weight_map))
        futures = [asyncio.wrap_future(engine.submit(r)) for r in requests]
        try:
            results = await asyncio.gather(*futures)
        except asyncio.CancelledError:
            for rid in (rid for r in requests for rid in r.sample_rids):
                engine.abort(rid)
            raise
        except Exception as err:  # noqa: BLE001 - a failed generation step, answered with why
            return _generation_failed(engine, err)
        out = [sample_to_sglang(s, state.tokenizer, state.routes_layout)
               for samples in results for s in samples]
        return out if as_list else out[0]

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=200 if await _health_probe(state) else 503)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if engine.busy:
            return Response("Cache not flushed. Please check for pending requests.",
                            status_code=400)
        return Response("Cache flushed.", status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await _body(request, required=False)
        rid = None if body.get("abort_all") else body.get("rid")
        if rid is None and not body.get("abort_all"):
            raise BadRequest("rid: give the request id to abort, or abort_all=true")
        await asyncio.wrap_future(engine.abort(str(rid) if rid is not None else None))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Any:
        mode = (await _body(request, required=False)).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode: {mode!r} must be one of abort, retract, in_place")
        await asyncio.wrap_future(engine.pause(mode))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation() -> Any:
        await asyncio.wrap_future(engine.resume())
        return {"message": "Generation continued successfully.", "status": "ok"}


async def _health_probe(state: ServerState) -> bool:
    """SGLang's ``/health``: whether the engine makes progress (a generation step, its own
    one-token probe's or a running request's) within ``health_check_timeout_s``; while
    generation is paused or memory released, nothing runs and the answer is False."""
    engine = state.engine
    if not engine.alive:
        return False
    steps = engine.steps
    probe = EngineRequest(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", prompt_ids=[0],
                          params=SamplingParams(max_new_tokens=1, temperature=0.0))
    future = engine.submit(probe)
    deadline = time.monotonic() + state.health_check_timeout_s
    while not future.done() and engine.steps == steps and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    engine.abort(probe.rid)
    if future.done() and future.exception() is not None:
        return False
    return future.done() or engine.steps != steps


def _info_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> Any:
        config = engine.runner.config
        return {"model_path": state.model_path, "tokenizer_path": state.model_path,
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": engine.weight_version, "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None)}

    @app.get("/get_server_info")
    async def get_server_info() -> Any:
        info = {**state.args, "internal_states": [engine.load_state()],
                "version": "megarl-embedded"}
        if engine.max_total_tokens is not None:  # SGLang's scheduler reports its pool size
            info["max_total_num_tokens"] = engine.max_total_tokens
        return info

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        body = await _body(request)
        version = str(_field(body, "new_version", (str, int)))

        def apply() -> None:
            if body.get("abort_all_requests", True):  # SGLang's default
                engine.abort_requests(None, "aborted for a weight version update")
            engine.weight_version = version

        await asyncio.wrap_future(engine.call(apply))
        # SGLang 0.5.10 http_server.py update_weight_version answers new_version too
        return JSONResponse({"success": True, "message": f"Weight version updated to {version}",
                             "new_version": version})

    @app.post("/release_memory_occupation")
    async def release_memory(request: Request) -> Response:
        tags = (await _body(request, required=False)).get("tags") or list(MEMORY_TAGS)
        try:
            await asyncio.wrap_future(engine.call(lambda: engine.release_memory(tags)))
        except ValueError as err:
            return _failure(str(err))
        return JSONResponse(None)

    @app.post("/resume_memory_occupation")
    async def resume_memory(request: Request) -> Response:
        tags = (await _body(request, required=False)).get("tags") or list(MEMORY_TAGS)
        try:
            await asyncio.wrap_future(engine.call(lambda: engine.resume_memory(tags)))
        except ValueError as err:
            return _failure(str(err))
        except RuntimeError as err:  # torch.OutOfMemoryError is one
            if not is_out_of_memory(err):
                raise
            return _resume_out_of_memory(engine, tags, err)
        return JSONResponse(None)


def _weight_routes(app: FastAPI, state: ServerState) -> None:
    receiver = state.receiver

    @app.post("/init_weights_update_group")
    async def init_group(request: Request) -> JSONResponse:
        body = await _body(request)
        args = (_field(body, "master_address", str), _field(body, "master_port", int),
                int(body.get("rank_offset", 1)), _field(body, "world_size", int),
                str(body.get("group_name", "weight_update_group")),
                str(body.get("backend", "nccl")))
        return _outcome(*await asyncio.to_thread(receiver.init_group, *args))

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request) -> JSONResponse:
        body = await _body(request, required=False)
        name = str(body.get("group_name", "weight_update_group"))
        return _outcome(*await asyncio.to_thread(receiver.destroy_group, name))

    @app.post("/update_weights_from_distributed")
    async def from_distributed(request: Request) -> JSONResponse:
        body = await _body(request)
        args = (_field(body, "names", list), _field(body, "dtypes", list),
                _field(body, "shapes", list), str(body.get("group_name", "weight_update_group")),
                body.get("weight_version"), bool(body.get("abort_all_requests", False)),
                body.get("load_format"))
        return _outcome(*await asyncio.to_thread(receiver.receive, *args))

    @app.post("/update_weights_from_tensor")
    async def from_tensor(request: Request) -> JSONResponse:
        body = await _body(request)
        args = (_field(body, "serialized_named_tensors", list), body.get("load_format"),
                body.get("weight_version"), bool(body.get("abort_all_requests", False)),
                body.get("megarl_keep"), body.get("megarl_replay"))  # weight_updates' programs
        return _outcome(*await asyncio.to_thread(receiver.from_serialized, *args))

    @app.post("/update_weights_from_disk")
    async def from_disk(request: Request) -> JSONResponse:
        body = await _body(request)
        args = (_field(body, "model_path", str), body.get("weight_version"),
                bool(body.get("abort_all_requests", False)))
        return _outcome(*await asyncio.to_thread(receiver.from_disk, *args))

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request) -> Any:
        body = await _body(request, required=False) or dict(request.query_params)
        name = _field(body, "name", str)
        truncate = int(body.get("truncate_size", 100))
        return await asyncio.to_thread(receiver.get, name, truncate)

    @app.post("/weights_checker")
    async def weights_checker(request: Request) -> JSONResponse:
        body = await _body(request)
        return _outcome(*await asyncio.to_thread(receiver.check, _field(body, "action", str)))

    @app.post("/megarl/weights")
    async def megarl_weights(request: Request) -> Any:
        body = await _body(request)
        _field(body, "op", str)
        return await asyncio.to_thread(state.checkpoint.handle, body)


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI application serving ``state``'s engine."""
    app = FastAPI(title="megarl embedded rollout engine", docs_url=None, redoc_url=None,
                  openapi_url=None)
    if state.api_key:
        app.add_middleware(ApiKeyGuard, api_key=state.api_key)

    @app.exception_handler(InvalidBody)
    async def invalid_body(request: Request, err: InvalidBody) -> JSONResponse:
        return _error(str(err))

    @app.exception_handler(NormalizeError)
    async def normalize_error(request: Request, err: NormalizeError) -> JSONResponse:
        return JSONResponse({"error": {"message": str(err)}}, status_code=400)

    @app.exception_handler(KeyError)
    async def key_error(request: Request, err: KeyError) -> JSONResponse:
        return _failure(str(err.args[0]) if err.args else "unknown key")

    @app.exception_handler(ValueError)
    async def value_error(request: Request, err: ValueError) -> JSONResponse:
        return _failure(str(err))

    _generation_routes(app, state)
    _info_routes(app, state)
    _weight_routes(app, state)
    add_lora_routes(app, state.engine, _body)
    return app


def build_parser() -> argparse.ArgumentParser:
    """Command-line options (names follow ``sglang.launch_server`` where they overlap)."""
    p = argparse.ArgumentParser(prog="megarl serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", "--model-path", dest="model", required=True,
                   help="HF model directory (config.json + safetensors)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", help="auto: checkpoint dtype on GPU, fp32 on CPU")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="fp8: block-FP8 projections (e4m3 weights, 128x128 weight_scale_inv), "
                        "computed w8a8; weight updates must send FP8 weights and their scales")
    p.add_argument("--fp8-ignored-layers", nargs="*", default=[], metavar="MODULE",
                   help="FP8: modules named so stay in --dtype (ignored_layers, e.g. self_attn)")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (/load_lora_adapter*, lora_path in /generate); "
                        "decodes through the HF modules")
    p.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="dummy: random weights, no checkpoint read; /generate waits for a sync")
    p.add_argument("--enable-weights-cpu-backup", action="store_true",
                   help="released weights wait in host memory (else dropped: a weight update "
                        "must rewrite them before /generate runs again)")
    p.add_argument("--context-length", type=int, default=None,
                   help="max prompt + response tokens (default: max_position_embeddings)")
    p.add_argument("--max-running-requests", type=int, default=256, help="rows decoded together")
    p.add_argument("--max-prefill-tokens", type=int, default=16384, help="padded prompt tokens a step")
    p.add_argument("--mem-fraction-static", type=float, default=None,
                   help="as in SGLang: the KV cache gets what is free after the weights "
                        "loaded, less 1 - this fraction of what was free before they did "
                        f"(default {DEFAULT_MEM_FRACTION}). GPU only")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV token slots the cache may hold (overrides --mem-fraction-static; "
                        "default: from it on a GPU, unlimited on the CPU)")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="honour sampling_seed (ignored without it, as in SGLang); all n samples "
                        "of one request then share it, so send one request per sample")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="do not load a tokenizer; token ids in and out")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--health-check-timeout", type=float, default=20.0,
                   help="seconds /health waits for its one-token generation (SGLang: "
                        "SGLANG_HEALTH_CHECK_TIMEOUT, 20) before answering 503")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow custom modelling and tokenizer code shipped with the model")
    return p


def create_state(args: argparse.Namespace, api_key: str | None = None) -> ServerState:
    """Load the model and start the engine thread; ``api_key`` guards every endpoint. It leaves
    the calling process's torch settings alone (``--num-threads`` is applied by
    :func:`serve_main`, which owns its process)."""
    free_before_load = _free_device_memory(args.device)
    runner = ModelRunner(args.model, device=args.device, dtype=args.dtype,
                         context_length=args.context_length,
                         trust_remote_code=args.trust_remote_code, quantization=args.quantization,
                         enable_lora=args.enable_lora, fp8_ignored=tuple(args.fp8_ignored_layers),
                         weights_cpu_backup=args.enable_weights_cpu_backup,
                         load_format=args.load_format)
    budget = kv_token_budget(args, runner, free_before_load)
    engine = LocalEngine(runner, max_running_requests=args.max_running_requests,
                         max_prefill_tokens=args.max_prefill_tokens,
                         weight_version=args.weight_version, seed=args.random_seed,
                         deterministic=args.enable_deterministic_inference,
                         max_total_tokens=budget)
    tokenizer = None if args.skip_tokenizer_init else load_tokenizer(
        args.model, trust_remote_code=args.trust_remote_code)
    limits = Limits(runner.vocab_size, runner.context_length, runner.router.num_layers > 0)
    receiver = WeightReceiver(engine)
    state = ServerState(engine, receiver, tokenizer, limits, args.model,
                        {k: v for k, v in vars(args).items()},
                        CheckpointEndpoint(engine, receiver), api_key=api_key,
                        routes_layout=_routes_layout(args.model, runner),
                        health_check_timeout_s=args.health_check_timeout)
    engine.start()
    return state


def _free_device_memory(device: str | None) -> int | None:
    """Free bytes on the CUDA device the engine loads onto (None off CUDA)."""
    if not device or not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    return torch.cuda.mem_get_info(torch.device(device))[0]


def kv_token_budget(args: argparse.Namespace, runner: ModelRunner,
                    free_before_load: int | None = None) -> int | None:
    """The KV token slots the engine may hold: ``--max-total-tokens``, else on a GPU SGLang's
    sizing from ``--mem-fraction-static`` (``kv_cache.kv_slots``; ``free_before_load``: the free
    device bytes measured before the model loaded), else None (no limit on the CPU)."""
    if args.max_total_tokens is not None:
        if args.max_total_tokens < 1:
            raise ValueError(f"--max-total-tokens {args.max_total_tokens}: must be >= 1")
        return args.max_total_tokens
    if runner.device.type != "cuda":
        if args.mem_fraction_static is not None:
            logger.info("--mem-fraction-static has no effect on the CPU")
        return None
    fraction = DEFAULT_MEM_FRACTION if args.mem_fraction_static is None else args.mem_fraction_static
    if not 0 < fraction <= 1:
        raise ValueError(f"--mem-fraction-static {fraction}: must be in (0, 1]")
    free_after, total = torch.cuda.mem_get_info(runner.device)
    weights = runner.weight_bytes()
    if free_before_load is None:
        free_before_load = free_after + weights
    budget = kv_slots(free_before_load, free_after, fraction, runner.kv_bytes_per_token)
    if budget < 1:
        raise ValueError(
            f"--mem-fraction-static {fraction}: of the {free_before_load / GB:.1f} GB free on "
            f"the GPU ({total / GB:.1f} GB, the rest held by other processes) before the "
            f"{weights / GB:.1f} GB of weights loaded, {1 - fraction:.2f} stays free for "
            "activations, which leaves no room for a KV cache; raise it "
            "(rollout.gpu_memory_utilization), free the GPU or use more GPUs per engine")
    logger.info("KV cache: %d token slots (%.1f GB, --mem-fraction-static %.2f of %.1f GB free "
                "before the weights loaded)", budget, budget * runner.kv_bytes_per_token / GB,
                fraction, free_before_load / GB)
    return budget


def _routes_layout(model_path: str, runner: ModelRunner) -> RoutedExpertsLayout | None:
    """The served model's routed-experts layout, checked against the routers it captures."""
    if runner.router.num_layers == 0:
        return None
    layout = RoutedExpertsLayout.from_model_path(model_path)
    if layout is None or len(layout.moe_layers) != runner.router.num_layers:
        raise ValueError(f"{model_path}/config.json names MoE layers "
                         f"{None if layout is None else layout.moe_layers}, but the model "
                         f"has {runner.router.num_layers} routers")
    return layout


def serve_main(argv: list[str]) -> int:
    """``megarl serve``: load the model and serve it until interrupted."""
    import uvicorn

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    api_key = os.environ.get(API_KEY_ENV) or None
    if not is_loopback_host(args.host) and api_key is None:
        print(f"--host {args.host}: refusing to serve a non-loopback address without an API key "
              f"(anyone who reaches the port could replace the weights); set {API_KEY_ENV} "
              "(rollout.api_key) or bind --host 127.0.0.1", file=sys.stderr)
        return 2
    if not Path(args.model, "config.json").exists():
        print(f"--model {args.model}: no config.json; pass an HF model directory", file=sys.stderr)
        return 2
    if not weight_files(args.model):
        print(f"--model {args.model}: config.json but no weights (*.safetensors, "
              "pytorch_model*.bin) there; pass the HF checkpoint directory, not a model card",
              file=sys.stderr)
        return 2
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    state = create_state(args, api_key)
    settle_long_lived_objects()  # the model's objects: garbage collection skips them from now on
    try:
        uvicorn.run(build_app(state), host=args.host, port=args.port, log_level=args.log_level)
    finally:
        state.engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))
