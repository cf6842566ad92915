"""The embedded engine's LoRA endpoints (``megarl/rollout/local/lora_endpoints.py``) read the
fields of SGLang's own request dataclasses and answer with its ``LoRAUpdateOutput``'s
(``sglang/srt/managers/io_struct.py``; handlers in ``srt/entrypoints/http_server.py``)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import types

import sglang_ref

from megarl.rollout.local import lora_endpoints

HANDLERS = {"load_lora_adapter": "LoadLoRAAdapterReqInput",
            "load_lora_adapter_from_tensors": "LoadLoRAAdapterFromTensorsReqInput",
            "unload_lora_adapter": "UnloadLoRAAdapterReqInput"}


def _fields_read(function_name: str) -> set[str]:
    """The ``body.get("...")`` / ``name_of(body)`` fields one endpoint reads (from the source)."""
    tree = ast.parse(inspect.getsource(lora_endpoints))
    handler = next(n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef)
                   and n.name == function_name)
    read = {node.args[0].value for node in ast.walk(handler)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get" and isinstance(node.args[0], ast.Constant)}
    if any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "name_of"
           for n in ast.walk(handler)):
        read.add("lora_name")
    if any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "_tensors"
           for n in ast.walk(handler)):
        read |= {"serialized_tensors", "load_format"}
    return read


def test_the_endpoints_read_sglangs_request_fields(sglang_io_struct: types.ModuleType) -> None:
    for handler, cls_name in HANDLERS.items():
        fields = {f.name for f in dataclasses.fields(getattr(sglang_io_struct, cls_name))}
        read = _fields_read(handler)
        assert "lora_name" in read and read <= fields, (handler, sorted(read - fields))
    assert _fields_read("load_lora_adapter") >= {"lora_path"}
    assert _fields_read("load_lora_adapter_from_tensors") >= {"config_dict",
                                                              "serialized_tensors"}
    generate = {f.name for f in dataclasses.fields(sglang_io_struct.GenerateReqInput)}
    assert "lora_path" in generate


def test_the_answer_is_sglangs_lora_update_output(sglang_io_struct: types.ModuleType) -> None:
    import json

    answer = json.loads(lora_endpoints._answer(None, "why").body)
    fields = {f.name for f in dataclasses.fields(sglang_io_struct.LoRAUpdateOutput)}
    assert set(answer) == fields - {"rid", "http_worker_ipc"}, (sorted(answer), sorted(fields))
    # the refusal without --enable-lora is SGLang's own sentence
    source = sglang_ref.source_of("srt/managers/tokenizer_communicator_mixin.py").read_text()
    assert lora_endpoints.NOT_ENABLED in source
