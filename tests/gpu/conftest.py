"""GPU tests: every test here is marked ``gpu`` and skipped on machines without CUDA."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from megarl.net import free_port


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark this folder's tests ``gpu`` and skip them without a CUDA device."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            item.add_marker(skip)


@pytest.fixture(scope="module")
def megatron_rank() -> Iterator[None]:
    """This process as the only NCCL rank, with megatron's parallel state torn down after."""
    import torch.distributed as dist

    from megarl.megatron.parallel import destroy_parallel

    port = free_port()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        destroy_parallel()
        dist.destroy_process_group()
