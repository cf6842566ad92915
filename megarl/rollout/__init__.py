"""The rollout pool: generation engines behind one interface.

``interface`` defines :class:`RolloutEngine`, :class:`SamplingParams` and
:class:`RolloutSample`; ``sglang`` launches SGLang servers and holds the HTTP client that drives
any server speaking SGLang's API; ``local`` is megarl's embedded engine, which serves that API
from an HF transformers model; ``balancer`` assigns requests to engines; ``process`` starts and
stops server processes; ``recovery`` brings failed engines back (restart, weight re-sync,
readmission).
"""

from megarl.rollout.interface import RolloutEngine, RolloutSample, SamplingParams

__all__ = ["RolloutEngine", "RolloutSample", "SamplingParams"]
