"""HF <-> Megatron checkpoint conversion for megarl, built on mbridge and megatron-core.

``megarl-convert`` (:mod:`bridge.cli`) has three subcommands:

- ``hf-to-mcore`` (:mod:`bridge.hf_to_mcore`): HF safetensors -> megatron dist checkpoint,
  written by the ranks of a TP/PP/EP layout; loads under any layout.
- ``mcore-to-hf`` (:mod:`bridge.mcore_to_hf`): dist checkpoint (converted or from training) ->
  sharded HF safetensors, streamed tensor by tensor in one process.
- ``verify`` (:mod:`bridge.verify`): Megatron's log-probs against HF transformers' on fixed
  prompts.

Input checks live in :mod:`bridge.checks`, the checkpoint format in
:mod:`bridge.mcore_checkpoint`, rank processes in :mod:`bridge.launch`.
"""
