"""The train-pool engine on megatron-core: parallel state, model build through mbridge, the
native (TransformerEngine-free) layer spec, the CPU compatibility layer and log-probs.

Submodules are imported explicitly (``from megarl.megatron.model import build_actor_model``):
importing megatron-core takes seconds, and this package stays cheap to import. The driver
imports only ``settings`` (the workers' specs), ``parallel``, ``offload`` and ``checkpoint_dirs``
(where to resume from), which do not import megatron-core (tests/test_layering.py checks it).
"""
