"""A loopback HTTP server that records the JSON bodies it receives and answers like SGLang 0.5.10
(``sglang/srt/entrypoints/http_server.py``), so tests see what megarl's client really sends."""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from megarl.rollout.process import free_port
from megarl.rollout.routed_experts import RoutedExpertsLayout

ROUTED_LAYOUT = RoutedExpertsLayout(num_layers=3, moe_layers=(1, 2), top_k=2)
"""The routed experts the recorder returns: rows for every layer, as SGLang sends them; layer 0
is dense (its columns are dropped by the client)."""


@dataclass
class Recorded:
    """One request as received."""

    method: str
    path: str
    body: Any


@dataclass
class Recorder:
    """What the server received, in order."""

    url: str
    requests: list[Recorded] = field(default_factory=list)

    def bodies(self, path: str) -> list[Any]:
        """The JSON bodies sent to ``path``."""
        return [r.body for r in self.requests if r.path == path]


def _sample(prompt: list[int], params: dict[str, Any], return_logprob: bool,
            routed: bool) -> dict[str, Any]:
    """One sample as SGLang answers it with --skip-tokenizer-init (tokenizer_manager.py)."""
    out = [7] * min(2, int(params.get("max_new_tokens", 128)))
    meta: dict[str, Any] = {
        "id": uuid.uuid4().hex, "finish_reason": {"type": "length", "length": len(out)},
        "prompt_tokens": len(prompt), "completion_tokens": len(out), "cached_tokens": 0,
        "weight_version": "default", "e2e_latency": 0.01, "total_retractions": 0}
    if return_logprob:
        meta["output_token_logprobs"] = [[-0.5, t, None] for t in out]
    if routed:
        layers, top_k = ROUTED_LAYOUT.num_layers, ROUTED_LAYOUT.top_k
        rows = len(prompt) + len(out) - 1  # routed_experts_capturer.py: seqlen - 1 rows
        values = bytes(4 * rows * layers * top_k)
        meta["routed_experts"] = base64.b64encode(values).decode()
    return {"output_ids": out, "meta_info": meta}


def _generate(body: dict[str, Any]) -> Any:
    ids = body["input_ids"]
    batch = isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    params = body.get("sampling_params") or {}
    params = params if isinstance(params, list) else [params] * len(prompts)
    logprob = body.get("return_logprob") or False
    out = [_sample(p, sp, bool(logprob), bool(body.get("return_routed_experts")))
           for _ in range(int(params[0].get("n", 1))) for p, sp in zip(prompts, params)]
    return out if batch or len(out) > 1 else out[0]


def _answer(path: str, body: Any) -> Response:
    ok = {"success": True, "message": "Succeeded"}
    if path == "/generate":
        return JSONResponse(_generate(body))
    if path == "/abort_request":
        return Response(status_code=200)  # http_server.py abort_request: empty 200
    if path in ("/pause_generation", "/continue_generation"):
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})
    if path in ("/release_memory_occupation", "/resume_memory_occupation"):
        return JSONResponse(None)  # http_server.py: the handler returns None -> null body
    if path == "/update_weight_version":
        return JSONResponse({**ok, "new_version": body["new_version"]})
    if path == "/flush_cache":
        return Response("Cache flushed.\nPlease check backend logs for more details. "
                        "(When there are running or waiting requests, the operation will not "
                        "be performed.)\n", status_code=200)
    if path in ("/model_info", "/get_model_info"):
        return JSONResponse({"model_path": "/m", "tokenizer_path": "/m", "is_generation": True,
                             "preferred_sampling_params": None, "weight_version": "default",
                             "has_image_understanding": False, "has_audio_understanding": False,
                             "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]})
    return JSONResponse(ok)


def _app(recorder: Recorder) -> FastAPI:
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def record(path: str, request: Request) -> Response:
        raw = await request.body()
        body = json.loads(raw) if raw.strip() else None
        recorder.requests.append(Recorded(request.method, "/" + path, body))
        return _answer("/" + path, body)

    return app


@contextmanager
def recording_server() -> Iterator[Recorder]:
    """A :class:`Recorder` whose server listens on 127.0.0.1 for the duration of the block."""
    port = free_port()
    recorder = Recorder(f"http://127.0.0.1:{port}")
    server = uvicorn.Server(uvicorn.Config(_app(recorder), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the recording server did not start")
        time.sleep(0.02)
    try:
        yield recorder
    finally:
        server.should_exit = True
        thread.join(10)
