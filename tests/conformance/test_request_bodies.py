"""Every request body megarl's SGLang client sends is one real SGLang's request dataclasses
accept (``sglang/srt/managers/io_struct.py``, ``sglang/srt/sampling/sampling_params.py``).

The bodies are captured from the client itself, talking to a recording server on loopback.
SGLang's FastAPI handlers take these dataclasses as the body type (``http_server.py``), so
pydantic drops unknown fields silently: a field SGLang does not know is a setting that does
nothing, and is refused here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import types
import typing
from collections.abc import Awaitable, Callable
from typing import Any

import pydantic
import pytest
from recorder import ROUTED_LAYOUT, Recorder, recording_server

from megarl.rollout.interface import SamplingParams
from megarl.rollout.sglang.client import SGLangClient

# path -> the io_struct dataclass SGLang's handler of that path takes (http_server.py)
REQUEST_TYPES = {
    "/generate": "GenerateReqInput",
    "/abort_request": "AbortReq",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/get_weights_by_name": "GetWeightsByNameReqInput",
    "/weights_checker": "CheckWeightsReqInput",
}

VOCAB_SIZE = 1000
PARAMS = [  # every sampling option megarl's SamplingParams has, away from its default
    SamplingParams(max_new_tokens=2),
    SamplingParams(max_new_tokens=2, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05,
                   stop_token_ids=(2, 3), n=3, seed=11, ignore_eos=True, min_new_tokens=1),
    SamplingParams(max_new_tokens=2, temperature=0.0),
]

Call = Callable[[SGLangClient], Awaitable[Any]]


def _generate(params: SamplingParams) -> Call:
    return lambda c: c.generate([[5, 6, 7], [8, 9]], params, return_logprob=True,
                                return_routed_experts=True)


def _pause(mode: str) -> Call:
    return lambda c: c.pause(mode)

# name -> one client call; together they use every endpoint and every option the client has
CALLS: dict[str, Call] = {
    **{f"generate[{i}]": _generate(p) for i, p in enumerate(PARAMS)},
    "generate_seeds_rids": lambda c: c.generate([[5, 6], [7]], PARAMS[1], rids=["r-a", "r-b"],
                                                seeds=[100, 200], return_logprob=False),
    "abort_rid": lambda c: c.abort("r-a"),
    "abort_all": lambda c: c.abort(),
    **{f"pause[{mode}]": _pause(mode) for mode in ("abort", "retract", "in_place")},
    "resume": lambda c: c.resume(),
    "flush_cache": lambda c: c.flush_cache(),
    "release_memory_all": lambda c: c.release_memory(),
    "release_memory_tags": lambda c: c.release_memory(["kv_cache", "weights"]),
    "resume_memory_all": lambda c: c.resume_memory(),
    "resume_memory_tags": lambda c: c.resume_memory(["weights"]),
    "init_weights_update_group": lambda c: c.init_weights_update_group(
        "10.0.0.1", 29500, world_size=2, group_name="g", backend="nccl"),
    "update_weights_from_distributed": lambda c: c.update_weights_from_distributed(
        ["a.weight", "b.bias"], ["torch.bfloat16", "float32"], [[4, 8], [8]], group_name="g",
        weight_version="3", flush_cache=False, abort_all_requests=True),
    "update_weights_from_distributed_defaults": lambda c: c.update_weights_from_distributed(
        ["a.weight"], ["bfloat16"], [[4, 8]]),
    "update_weights_from_tensor": lambda c: c.update_weights_from_tensor(
        [["c2VyaWFsaXplZA=="]], load_format="flattened_bucket", weight_version="4",
        flush_cache=True),
    "update_weights_from_tensor_defaults": lambda c: c.update_weights_from_tensor(
        [["c2VyaWFsaXplZA=="]]),
    "update_weights_from_disk": lambda c: c.update_weights_from_disk("/ckpt/step_5",
                                                                     weight_version="5"),
    "update_weight_version": lambda c: c.update_weight_version("6"),
    "update_weight_version_abort": lambda c: c.update_weight_version("7",
                                                                     abort_all_requests=True),
    "get_weights_by_name": lambda c: c.get_weights_by_name("model.embed_tokens.weight", 10),
    "check_weights": lambda c: c.check_weights("compare"),
    "destroy_weights_update_group": lambda c: c.destroy_weights_update_group("g"),
}


@dataclasses.dataclass
class Capture:
    """The bodies the client sent, and how each call ended (None: it returned)."""

    recorder: Recorder
    errors: dict[str, BaseException | None]


@pytest.fixture(scope="module")
def capture() -> Capture:
    """Run every call of CALLS against the recording server."""

    async def run(recorder: Recorder) -> dict[str, BaseException | None]:
        client = SGLangClient([recorder.url], routed_experts_layout=ROUTED_LAYOUT,
                              max_retries=0)
        errors: dict[str, BaseException | None] = {}
        try:
            for name, call in CALLS.items():
                try:
                    await call(client)
                    errors[name] = None
                except Exception as err:  # noqa: BLE001 - recorded, asserted in a test below
                    errors[name] = err
        finally:
            await client.close()
        return errors

    with recording_server() as recorder:
        errors = asyncio.run(run(recorder))
    return Capture(recorder, errors)


def _type_errors(cls: type, body: dict[str, Any], module: types.ModuleType) -> list[str]:
    """Fields of ``body`` whose JSON value is not of the type ``cls`` declares (strict)."""
    hints = typing.get_type_hints(cls, globalns=vars(module))
    problems = []
    for name, value in body.items():
        try:
            pydantic.TypeAdapter(hints[name]).validate_python(value, strict=True)
        except pydantic.ValidationError as err:
            problems.append(f"{name}={value!r}: not {hints[name]} ({err.errors()[0]['msg']})")
    return problems


def _accept(path: str, body: Any, io_struct: types.ModuleType) -> Any:
    """Build SGLang's request object from ``body`` the way its server does, or fail."""
    cls = getattr(io_struct, REQUEST_TYPES[path])
    body = {} if body is None else body
    known = {f.name for f in dataclasses.fields(cls)}
    assert set(body) <= known, f"{path}: fields unknown to {cls.__name__}: " \
                               f"{sorted(set(body) - known)} (SGLang would ignore them)"
    assert not _type_errors(cls, body, io_struct), _type_errors(cls, body, io_struct)
    return cls(**body)


def test_every_call_reached_the_server(capture: Capture) -> None:
    paths = {r.path for r in capture.recorder.requests}
    assert set(REQUEST_TYPES) <= paths | {"/flush_cache"}, sorted(set(REQUEST_TYPES) - paths)


@pytest.mark.parametrize("path", sorted(set(REQUEST_TYPES) - {"/generate"}))
def test_control_bodies_are_sglang_requests(path: str, capture: Capture,
                                            sglang_io_struct: types.ModuleType) -> None:
    bodies = capture.recorder.bodies(path)
    assert bodies, f"no call sent {path}"
    for body in bodies:
        _accept(path, body, sglang_io_struct)


def test_generate_bodies_are_sglang_requests(capture: Capture,
                                             sglang_io_struct: types.ModuleType) -> None:
    """GenerateReqInput takes the body and normalises it without a tokenizer
    (normalize_batch_and_arguments), and every sampling_params object passes SGLang's
    SamplingParams(**params).normalize(None) and .verify(vocab_size), as tokenizer_manager.py
    does for each request."""
    bodies = capture.recorder.bodies("/generate")
    assert len(bodies) >= len(PARAMS)
    sampling_cls = sglang_io_struct.SamplingParams
    for body in bodies:
        request = _accept("/generate", body, sglang_io_struct)
        request.normalize_batch_and_arguments()
        params = request.sampling_params
        for sp in params if isinstance(params, list) else [params]:
            sampling = sampling_cls(**sp)
            sampling.normalize(None)
            sampling.verify(VOCAB_SIZE)


def test_generate_sends_the_options_asked_for(capture: Capture) -> None:
    """What SGLang reads back from the bodies is what the calls asked for."""
    bodies = capture.recorder.bodies("/generate")

    def each(value: Any) -> list[Any]:  # a batch carries one value per item
        return value if isinstance(value, list) else [value]

    sent = [sp for b in bodies for sp in each(b["sampling_params"])]
    assert any(sp.get("n", 1) > 1 or sp.get("sampling_seed") is not None for sp in sent)
    assert all(b.get("return_routed_experts") for b in bodies[:2 * len(PARAMS)])
    rids = {r for b in bodies for r in each(b.get("rid"))}
    assert any(str(r).startswith(("r-a", "r-b")) for r in rids), rids


@pytest.mark.parametrize("name", list(CALLS))
def test_the_client_reads_sglangs_answer(name: str, capture: Capture) -> None:
    """Each call returns normally when the server answers the way SGLang 0.5.10 does."""
    error = capture.errors[name]
    assert error is None, f"{name}: {type(error).__name__}: {error}"


@pytest.mark.parametrize("path, body, problem", [
    ("/update_weights_from_distributed",
     {"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[1]], "weight_version": 3}, "not"),
    ("/init_weights_update_group", {"master_address": "h", "master_port": "29500",
                                    "rank_offset": 1, "world_size": 2}, "not"),
    ("/update_weight_version", {"new_version": "1", "abort_all": True}, "unknown"),
])
def test_the_reference_refuses_what_sglang_would_not_read(
        path: str, body: dict[str, Any], problem: str,
        sglang_io_struct: types.ModuleType) -> None:
    """The checks above are not vacuous: a wrong type or an unknown field fails them."""
    with pytest.raises(AssertionError, match=problem):
        _accept(path, body, sglang_io_struct)
