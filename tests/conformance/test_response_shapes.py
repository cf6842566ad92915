"""The embedded server answers each endpoint megarl uses with real SGLang 0.5.10's status code and
body shape (read in ``sglang/srt/entrypoints/http_server.py`` and the managers it calls).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.local.launch import launch_local_engines

PROMPT = [5, 6, 7, 8]
SP = {"max_new_tokens": 3, "temperature": 1.0}
MOE_FIELDS = {"num_moe_layers", "moe_top_k"}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An embedded server on a tiny Qwen3-MoE, token ids only (as megarl launches SGLang)."""
    model = make_tiny_model(tmp_path_factory.mktemp("moe") / "model", arch="qwen3_moe", seed=0)
    servers = launch_local_engines(str(model), 1, num_threads=1,
                                   log_dir=tmp_path_factory.mktemp("logs"),
                                   extra_args=["--random-seed", "0", "--skip-tokenizer-init"],
                                   ready_timeout_s=120)
    try:
        yield servers[0].url
    finally:
        servers[0].stop()


@dataclass
class Row:
    """One request and the answer real SGLang gives to it."""

    method: str
    path: str
    body: Any
    status: int
    check: Callable[[Any], bool]
    """On the decoded JSON body (None for an empty body)."""
    source: str
    """Where the expectation comes from, in sglang/srt/."""


def _is_sample(item: Any) -> bool:
    meta = item.get("meta_info", {}) if isinstance(item, dict) else {}
    return (isinstance(item.get("output_ids"), list)
            and {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                 "weight_version"} <= set(meta)
            and isinstance(meta["finish_reason"], dict) and "type" in meta["finish_reason"])


def _n_samples_with_own_ids(n: int, parent: str) -> Callable[[Any], bool]:
    def check(body: Any) -> bool:
        ids = [s["meta_info"]["id"] for s in body] if isinstance(body, list) else []
        return (len(ids) == n and all(_is_sample(s) for s in body) and len(set(ids)) == n
                and not any(i.startswith(parent) for i in ids))
    return check


def _status_ok(body: Any) -> bool:
    """``{"message": "Generation paused successfully.", "status": "ok"}`` (message text aside)."""
    return isinstance(body, dict) and set(body) == {"message", "status"} \
        and body["status"] == "ok" and isinstance(body["message"], str)


def _error(body: Any) -> bool:
    return isinstance(body, dict) and isinstance(body.get("error"), dict) \
        and isinstance(body["error"].get("message"), str)


ROWS = {
    # entrypoints/http_server.py generate_request; managers/tokenizer_manager.py: one object
    # per sample, meta_info with id and a finish_reason object
    "generate": Row("POST", "/generate", {"input_ids": PROMPT, "sampling_params": SP,
                                          "rid": "one"}, 200,
                    lambda b: _is_sample(b) and b["meta_info"]["id"] == "one",
                    "entrypoints/http_server.py generate_request"),
    # tokenizer_manager.py: with --skip-tokenizer-init there is no detokenizer, the answer has
    # output_ids and meta_info but no "text"
    "generate_no_text": Row("POST", "/generate", {"input_ids": PROMPT, "sampling_params": SP},
                            200, lambda b: _is_sample(b) and "text" not in b,
                            "managers/tokenizer_manager.py (skip_tokenizer_init)"),
    # tokenizer_manager.py _handle_batch_request: n > 1 gives every sample a fresh uuid rid,
    # the parent rid is dropped
    "generate_n": Row("POST", "/generate", {"input_ids": PROMPT, "sampling_params": {**SP, "n": 3},
                                            "rid": "parent"}, 200,
                      _n_samples_with_own_ids(3, "parent"),
                      "managers/tokenizer_manager.py _handle_batch_request"),
    # managers/io_struct.py GenerateReqInput._handle_parallel_sampling raises ValueError,
    # http_server.py generate_request answers it with _create_error_response: 400 {error}
    "generate_mixed_n": Row(
        "POST", "/generate",
        {"input_ids": [PROMPT, PROMPT], "sampling_params": [{**SP, "n": 2}, {**SP, "n": 1}]},
        400, _error, "managers/io_struct.py _handle_parallel_sampling"),
    # http_server.py abort_request: Response(status_code=200), no body
    "abort_request": Row("POST", "/abort_request", {"rid": "nothing-running"}, 200,
                         lambda b: b is None, "entrypoints/http_server.py abort_request"),
    # http_server.py pause_generation / continue_generation
    "pause_generation": Row("POST", "/pause_generation", {"mode": "retract"}, 200,
                            lambda b: _status_ok(b),
                            "entrypoints/http_server.py pause_generation"),
    "continue_generation": Row("POST", "/continue_generation", {}, 200,
                               lambda b: _status_ok(b),
                               "entrypoints/http_server.py continue_generation"),
    # http_server.py model_info (and its deprecated alias get_model_info): no MoE fields
    "model_info": Row("GET", "/model_info", None, 200,
                      lambda b: "weight_version" in b and not MOE_FIELDS & set(b),
                      "entrypoints/http_server.py model_info"),
    "get_model_info": Row("GET", "/get_model_info", None, 200,
                          lambda b: "weight_version" in b and not MOE_FIELDS & set(b),
                          "entrypoints/http_server.py get_model_info"),
    # http_server.py weight_version: HTTPException(404) in 0.5.10 (gone in 0.5.23)
    "get_weight_version": Row("GET", "/get_weight_version", None, 404, lambda b: True,
                              "entrypoints/http_server.py weight_version"),
    # http_server.py update_weight_version: {success, message, new_version}
    "update_weight_version": Row(
        "POST", "/update_weight_version", {"new_version": "v1", "abort_all_requests": False},
        200, lambda b: b.get("success") is True and b.get("new_version") == "v1"
        and isinstance(b.get("message"), str),
        "entrypoints/http_server.py update_weight_version"),
    # http_server.py flush_cache: 200 with a plain-text body when idle
    "flush_cache": Row("POST", "/flush_cache", None, 200, lambda b: True,
                       "entrypoints/http_server.py flush_cache"),
    # http_server.py update_weights_from_disk: 400 {success: false, message} on failure
    "update_weights_from_disk_fails": Row(
        "POST", "/update_weights_from_disk", {"model_path": "/nonexistent/ckpt"}, 400,
        lambda b: b.get("success") is False and isinstance(b.get("message"), str),
        "entrypoints/http_server.py update_weights_from_disk"),
    # http_server.py release/resume_memory_occupation: the handler returns None on success ->
    # HTTP 200 with a JSON null body (resume runs after release in this table)
    "release_memory_occupation": Row(
        "POST", "/release_memory_occupation", {"tags": None}, 200, lambda b: b is None,
        "entrypoints/http_server.py release_memory_occupation"),
    "resume_memory_occupation": Row(
        "POST", "/resume_memory_occupation", {"tags": None}, 200, lambda b: b is None,
        "entrypoints/http_server.py resume_memory_occupation"),
    # http_server.py health (= health_generate): 200 when serving
    "health": Row("GET", "/health", None, 200, lambda b: True,
                  "entrypoints/http_server.py health_generate"),
    # tokenizer_communicator_mixin.py load_lora_adapter_from_tensors / unload_lora_adapter: a
    # server without --enable-lora answers LoRAUpdateOutput(success=False) with its ValueError,
    # which http_server.py returns as 400
    "load_lora_adapter_from_tensors": Row(
        "POST", "/load_lora_adapter_from_tensors",
        {"lora_name": "policy-v1", "config_dict": {"r": 8}, "serialized_tensors": ""}, 400,
        lambda b: b["success"] is False and "--enable-lora" in b["error_message"],
        "managers/tokenizer_communicator_mixin.py load_lora_adapter_from_tensors"),
    "unload_lora_adapter": Row(
        "POST", "/unload_lora_adapter", {"lora_name": "policy-v1"}, 400,
        lambda b: b["success"] is False and "--enable-lora" in b["error_message"],
        "managers/tokenizer_communicator_mixin.py unload_lora_adapter"),
}


def _decode(response: httpx.Response) -> Any:
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        return response.text


@pytest.mark.parametrize("name", list(ROWS))
def test_answer_has_sglangs_shape(name: str, url: str) -> None:
    row = ROWS[name]
    response = httpx.request(row.method, url + row.path, json=row.body, timeout=60)
    body = _decode(response)
    assert response.status_code == row.status, f"{row.source}: status {response.status_code}, " \
                                                f"body {str(body)[:300]}"
    assert row.check(body), f"{row.source}: unexpected body {str(body)[:300]}"


def test_every_sglang_path_the_client_uses_has_a_row() -> None:
    """The table covers the control and weight paths the client calls (tested on their own:
    group and tensor updates need a sender)."""
    covered = {row.path for row in ROWS.values()}
    others = {"/init_weights_update_group", "/update_weights_from_distributed",
              "/update_weights_from_tensor", "/destroy_weights_update_group",
              "/get_weights_by_name", "/weights_checker"}
    sglang = Path(__file__).parents[2] / "megarl/rollout/sglang"
    used = {path for name in ("client.py", "engine_calls.py")
            for path in re.findall(r'"(/[a-z_]+)"', (sglang / name).read_text())}
    assert used <= covered | others, sorted(used - covered - others)
