"""The process group that carries weights from the trainer's sender to rollout engines.

It is created the way SGLang's engines create theirs (``init_custom_process_group``): a TCP
rendezvous at ``master_address:master_port`` where the sender is rank 0 and hosts the store, a
``PrefixStore`` named after the group, and a process group that is *not* the default one, so
it lives next to Megatron's groups in the trainer. Both sides of megarl use this function, and
a sender built this way also talks to real SGLang engines. The group itself is built by
:mod:`megarl.weights.group` (the checkpoint engine's); this module adds the dtype names.
"""

from __future__ import annotations

import torch

from megarl.weights.group import close_weight_update_group, open_weight_update_group

__all__ = ["DTYPES", "close_weight_update_group", "open_weight_update_group", "parse_dtype"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16,
    "half": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool, "float8_e4m3fn": torch.float8_e4m3fn,
}


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``."""
    key = name.removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"dtype {name!r} is not known; use one of {sorted(DTYPES)}")
    return DTYPES[key]
