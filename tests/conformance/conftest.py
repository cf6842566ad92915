"""Real SGLang modules, loaded once per session as the reference (see ``sglang_ref``)."""

from __future__ import annotations

import argparse
import json
import re
import types

import pytest
import sglang_ref


@pytest.fixture(scope="session")
def sglang_server_args() -> types.ModuleType:
    """``sglang/srt/server_args.py``; what it imports for GPU detection, parsers and LoRA is
    stubbed, except the argument types the parser really calls (copied from
    ``srt/utils/common.py`` by :func:`sglang_ref.load_definitions`)."""
    arg_types = sglang_ref.load_definitions(
        "srt/utils/common.py", ["nullable_str", "human_readable_int", "json_list_type"],
        {"re": re, "json": json, "argparse": argparse, "orjson": json})
    stubbed = ["sglang.srt.connector", "sglang.srt.environ", "sglang.srt.function_call",
               "sglang.srt.layers", "sglang.srt.lora", "sglang.srt.parser", "sglang.srt.utils",
               "sglang.utils"]
    stubs = {name: {} for name in stubbed}
    # the LoRA target choices of --lora-target-modules, as common.py assigns them
    stubs["sglang.srt.utils.common"] = {**arg_types, **sglang_ref.load_constants(
        "srt/utils/common.py", ["SUPPORTED_LORA_TARGET_MODULES", "LORA_TARGET_ALL_MODULES"])}
    return sglang_ref.import_with_stubs("sglang.srt.server_args", stubs)


@pytest.fixture(scope="session")
def sglang_io_struct() -> types.ModuleType:
    """``sglang/srt/managers/io_struct.py`` with its real ``SamplingParams``; LoRA, scheduling,
    timing and image types are stubbed, ``has_valid_data`` is SGLang's own."""
    mm_utils = sglang_ref.load_definitions(
        "srt/multimodal/mm_utils.py", ["has_valid_data"],
        {"flatten_nested_list": _flatten_nested_list()})
    stubbed = ["sglang.srt.lora", "sglang.srt.managers.schedule_batch", "sglang.srt.multimodal",
               "sglang.srt.observability", "sglang.srt.utils"]
    stubs = {name: {} for name in stubbed}
    stubs["sglang.srt.multimodal.mm_utils"] = mm_utils
    return sglang_ref.import_with_stubs("sglang.srt.managers.io_struct", stubs)


def _flatten_nested_list() -> object:
    return sglang_ref.load_definitions("srt/utils/common.py", ["flatten_nested_list"],
                                       {})["flatten_nested_list"]


@pytest.fixture(scope="session")
def sglang_tensor_bucket() -> types.ModuleType:
    """``sglang/srt/weight_sync/tensor_bucket.py`` (imports only torch), under its own name."""
    return sglang_ref.load_file("srt/weight_sync/tensor_bucket.py",
                                "sglang.srt.weight_sync.tensor_bucket")


@pytest.fixture(scope="session")
def sglang_serializer() -> types.SimpleNamespace:
    """``MultiprocessingSerializer`` and its ``SafeUnpickler`` from ``srt/utils/common.py``."""
    import base64
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    defs = sglang_ref.load_definitions(
        "srt/utils/common.py", ["MultiprocessingSerializer", "SafeUnpickler"],
        {"io": io, "pickle": pickle, "ForkingPickler": ForkingPickler, "pybase64": base64})
    return types.SimpleNamespace(**defs)
