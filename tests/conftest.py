"""The test process's process-wide torch state: set once, and checked after every test.

Reference computations run in the test process (HF log-probs, reference optimizer steps), and
their fp32 rounding depends on torch's thread count, which orders the reductions. Test modules
used to call ``torch.set_num_threads(1)`` at import, so a test's numbers depended on which other
files pytest had collected (issue 28: the DP=2 AdamW test failed after
``tests/conformance/test_response_shapes.py``). The count is now set here, once, for every run;
one thread because the tests start rank processes and servers of their own on 2 cores.

After every test the thread count, the default dtype and grad mode must be what they were
before: library code must leave its caller's process as it found it (STYLE.md), and a test that
changes them must restore them.

The session ends through :mod:`ray_exit` (Ray's leftover threads and the interpreter's exit);
:mod:`xdist_units` shares the suite between ``pytest -n 2``'s workers.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from ray_exit import pytest_sessionfinish, pytest_unconfigure  # noqa: F401 (hooks)
from xdist_units import (  # noqa: F401 (hooks)
    pytest_collection_modifyitems,
    pytest_xdist_make_scheduler,
)

TEST_THREADS = 1


def pytest_configure(config: pytest.Config) -> None:
    torch.set_num_threads(TEST_THREADS)


def _process_state() -> dict[str, object]:
    return {"num_threads": torch.get_num_threads(), "default_dtype": torch.get_default_dtype(),
            "grad_enabled": torch.is_grad_enabled()}


@pytest.fixture(autouse=True)
def _process_state_is_left_as_found(request: pytest.FixtureRequest) -> Iterator[None]:
    before = _process_state()
    yield
    after = _process_state()
    if after != before:
        torch.set_num_threads(before["num_threads"])  # type: ignore[arg-type]
        torch.set_default_dtype(before["default_dtype"])  # type: ignore[arg-type]
        torch.set_grad_enabled(before["grad_enabled"])  # type: ignore[arg-type]
        changed = {k: f"{before[k]} -> {after[k]}" for k in before if before[k] != after[k]}
        pytest.fail(f"{request.node.nodeid} left torch's process-wide state changed: {changed}; "
                    "restore it (e.g. in a try/finally), or set it in a subprocess")
