"""The trainer satisfies the StepDriver protocol the schedulers see it through."""

from __future__ import annotations

import inspect

from megarl.scheduler.driver import StepDriver
from megarl.trainer import Trainer


def test_the_trainer_has_everything_a_scheduler_uses():
    methods = [name for name, _ in inspect.getmembers(StepDriver, inspect.isfunction)
               if not name.startswith("_")]
    assert methods and all(callable(getattr(Trainer, name, None)) for name in methods), methods
    for name in methods:
        wanted = inspect.signature(getattr(StepDriver, name)).parameters
        assert list(inspect.signature(getattr(Trainer, name)).parameters) == list(wanted), name
    source = "".join(inspect.getsource(cls) for cls in Trainer.__mro__  # its own and its bases
                     if cls.__module__.startswith("megarl."))
    missing = [name for name in StepDriver.__annotations__ if f"self.{name} =" not in source
               and f"self.{name}: " not in source]
    assert not missing, missing
