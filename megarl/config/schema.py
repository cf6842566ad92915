"""The run config: one pydantic model for a whole megarl job.

Sections: ``model, data, actor, ref, critic`` (schema_train.py), ``rollout, checkpoint_engine,
algorithm, scheduler, resources, trainer, reward, ray`` (here). Every field is typed, defaulted
and documented in one place. A few fields default to ``null`` meaning "follow another field";
:class:`RunConfig` fills them when it is built (listed in :data:`DERIVED_FIELDS`), so a loaded
config always holds concrete values.
"""

from __future__ import annotations

import re
import typing
from typing import Literal

from pydantic import Field, field_validator, model_validator

from megarl.config.schema_common import Dtype, OffloadConfig, OptimConfig, ParallelConfig, Section
from megarl.config.schema_train import (
    ActorConfig,
    CriticConfig,
    DataConfig,
    KLType,
    ModelConfig,
    RefConfig,
)

# verl's rejection-sampling criteria: aggregation level x divergence estimator.
RolloutRS = Literal[
    "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",
]


class MultiTurnConfig(Section):
    """Multi-turn, tool-using episodes (names follow verl's `rollout.multi_turn`): model turns
    and environment turns, kept as token ids; environment tokens get loss mask 0."""

    enable: bool = Field(False, description=(
        "generate episodes of model and environment turns instead of one response per sample"))
    max_assistant_turns: int | None = Field(5, ge=1, description=(
        "model turns per episode at most; null = bounded by the token budget only"))
    max_user_turns: int | None = Field(None, ge=1, description=(
        "environment (tool) turns per episode at most; null = bounded by the other budgets"))
    max_tokens_per_turn: int | None = Field(None, ge=1, description=(
        "tokens one model turn may generate; null = what is left of the episode budget, which "
        "is `data.max_response_length` (all tokens after the prompt, model and environment)"))
    format: Literal["hermes"] = Field("hermes", description=(
        "tool-call and chat format: hermes = Qwen3/Hermes `<tool_call>{json}</tool_call>`, "
        "results as a user turn of `<tool_response>`s"))
    tools: list[str] = Field(default_factory=list, description=(
        "tool functions by import path (`package.module:function`, a JSON schema attached "
        "with `megarl.rollout.agent.tool`); built in: `megarl.rollout.agent:calculator`, "
        "`megarl.rollout.agent:code_interpreter` (sandboxed Python)"))
    env: str | None = Field(None, description=(
        "instead of tools: an environment factory by import path, called with the prompt row "
        "and returning an object with `async step(text) -> StepResult(observation, reward, "
        "done)`; its rewards are added to the reward function's score"))
    max_tool_response_length: int = Field(256, ge=1, description=(
        "characters of one tool result shown to the model (longer results are cut)"))


class RolloutConfig(Section):
    """Generation on the rollout pool: engine backend, sampling and engine capacity."""

    backend: Literal["sglang", "local"] = Field("sglang", description=(
        "sglang = SGLang servers; local = megarl's embedded engine (same HTTP API, runs on CPU)"))
    n: int = Field(8, ge=1, description="responses sampled per prompt (the GRPO group size)")
    gpus_per_engine: int = Field(1, ge=1, description=(
        "GPUs of one engine, its tensor-parallel size (verl's rollout "
        "`tensor_model_parallel_size`); the number of engines is rollout-pool GPUs / this"))
    temperature: float = Field(1.0, ge=0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    top_k: int = Field(-1, ge=-1, description="top-k sampling; -1 = off")
    max_num_seqs: int | Literal["auto"] = Field("auto", description=(
        "concurrent sequences per engine, passed to every engine as `--max-running-requests` "
        "(SGLang `max_running_requests`); auto = the sequences each engine receives per step, "
        "capped by the KV cache that fits (the number `megarl config show` prints)"))
    gpu_memory_utilization: float = Field(0.8, gt=0, le=1, description=(
        "SGLang's `mem_fraction_static`: an engine's KV cache gets what is free on its GPU "
        "after its weights load, less 1 - this fraction of what was free before they did "
        "(memory a colocated actor still holds is not the engine's); the embedded engine "
        "sizes its page pool the same way and admits rows while their pages fit it (a row "
        "that cannot stop early at its full length, others at their prompt plus a share of "
        "max_new_tokens that decays from 0.7 to 0.098 as SGLang's scheduler counts them; rows are "
        "retracted and rerun when the pool runs short); a decode or prefill that still runs "
        "out of device memory is retracted, its KV budget shrunk to 3/4 of what the cache held "
        "until the cache is next released, and rerun to the same tokens; after 3 failures in a "
        "row `/generate` answers 500 with the free memory and who holds it)"))
    colocate: bool = Field(True, description=(
        "engines share the train pool's GPUs (memory is released between phases); false = a "
        "separate `resources.rollout_pool`"))
    enable_return_routed_experts: bool | None = Field(None, description=(
        "engines return the routed experts of every token (needed by R3); null = on when "
        "`actor.router_replay.mode` is R3"))
    dtype: Dtype | None = Field(None, description="engine weight dtype; null = `model.dtype`")
    max_prefill_tokens: int | None = Field(None, ge=1, description=(
        "prompt tokens one prefill step may take (SGLang `--max-prefill-tokens`, the engine's "
        "token budget; both engines' default 16384); lower it where long prompts run out of "
        "memory in prefill"))
    chunked_prefill_size: int | None = Field(None, ge=-1, description=(
        "SGLang `--chunked-prefill-size`: prompts longer than this prefill in chunks (-1 = "
        "never; null = SGLang's choice by GPU memory); sglang backend only: the embedded engine "
        "prefills each prompt whole"))
    sglang_args: list[str] = Field(default_factory=list, description=(
        "more SGLang server flags, appended verbatim to every engine's command line (e.g. "
        "`[--cuda-graph-max-bs, '256']`, slime's `--sglang-*` pass-through); sglang backend only"))
    quantization: Literal["fp8"] | None = Field(None, description=(
        "weights the engines compute with: null = `rollout.dtype`; fp8 = blockwise FP8 "
        "(e4m3, 128x128 `weight_scale_inv` blocks, the format of DeepSeek-V3 / Qwen3 FP8 "
        "releases; docs/fp8.md), quantized on the train side at every weight sync and "
        "computed w8a8 (1x128 activation groups). The embedded engine quantizes the checkpoint "
        "itself at start; SGLang engines start from an FP8-serialized config with dummy weights "
        "and get the trainer's before the first generation (every TP-split projection must be "
        "whole 128-blocks per GPU). With fp8, "
        "algorithm.rollout_correction.rollout_is defaults to token and the health monitor's "
        "mismatch alarm to the FP8 baseline"))
    fp8_attention: bool = Field(True, description=(
        "with rollout.quantization=fp8: false keeps the attention projections (q/k/v/o, MLA's "
        "down/up projections) in `rollout.dtype` and quantizes only the MLPs and experts "
        "(config.json's `ignored_layers: [self_attn]`, which SGLang honours); at small batch "
        "sizes an FP8 GEMM with its activation quantization can be slower than bf16's "
        "(benchmarks/RESULTS.md). Refused without rollout.quantization=fp8"))
    load_format: Literal["auto", "dummy"] = Field("auto", description=(
        "how the engines get their first weights (SGLang's --load-format): auto = they read "
        "`model.path`'s safetensors; dummy = they build the model from its config.json alone, "
        "random and unread (no checkpoint load: the start of a large MoE engine), and the "
        "trainer syncs the actor's weights into them before the first generation, as after a "
        "resume; an engine that got none refuses /generate"))
    api_key: str | None = Field(None, repr=False, description=(
        "key every HTTP endpoint of the engines requires (`Authorization: Bearer <key>`), "
        "weight updates and control included; required when `host` is not a loopback "
        "address; null = none. Never logged; the saved config.yaml holds null in its place"))
    host: str = Field("127.0.0.1", description=(
        "interface the engine HTTP servers bind to; anything but a loopback address (e.g. "
        "0.0.0.0 for engines on other nodes) needs `api_key`"))
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig, description=(
        "multi-turn, tool-using episodes (agent loop)"))


class CheckpointEngineConfig(Section):
    """Weight streaming from the train pool to the rollout engines after each update."""

    backend: Literal["nccl", "nixl", "ipc", "disk", "auto"] = Field("auto", description=(
        "transport: nccl (gloo on CPU; separate pools only on GPUs), nixl, ipc (colocated only: "
        "SGLang's update_weights_from_tensor with CUDA IPC handles of flattened buckets, bytes "
        "inline on CPU; with megarl's embedded engine of one GPU, an actor on one model-parallel "
        "rank, no LoRA, no `actor.offload.param_offload` and nothing cast (no "
        "`rollout.quantization`, `rollout.dtype` the model's), the engine keeps the actor's "
        "parameter memory after the first syncs and each later sync is one replay post: "
        "`checkpoint_engine/replayed`), disk (shared file system); auto = ipc when colocated, "
        "else nccl. "
        "`megarl train` streams over ipc and nccl; nixl/disk run in `megarl bench weight-sync`"))
    bucket_size_mb: int = Field(2048, ge=1, description=(
        "size of one streamed bucket (verl `update_weights_bucket_megabytes`); each sending rank "
        "holds at most two (one packed while the other is in flight; counted in the sync's "
        "memory estimate)"))


class KLControlConfig(Section):
    """Coefficient controller of the in-reward KL penalty."""

    type: Literal["fixed", "adaptive"] = Field("fixed", description="fixed or adaptive coefficient")
    kl_coef: float = Field(0.001, ge=0, description="(initial) KL penalty coefficient beta")
    horizon: int = Field(10000, ge=1, description=(
        "adaptive controller horizon: each step beta *= 1 + clip(kl / target_kl - 1, -0.2, 0.2)"
        " x sequences / horizon (verl's AdaptiveKLController); beta is saved in checkpoints"))
    target_kl: float = Field(0.1, gt=0, description="adaptive controller target KL")


class FilterGroupsConfig(Section):
    """DAPO dynamic sampling: drop prompt groups whose responses all score the same."""

    enable: bool = Field(False, description=(
        "drop groups with zero reward variance and refill (every scheduler; colocate_sync and "
        "one_step_off generate further batches of prompts until the step is full and log the "
        "number of rounds as `train/num_gen_batches`)"))
    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] = Field("score", description=(
        "per-response value whose variance decides whether a group is kept: score, or "
        "seq_reward (the same for an outcome reward: the sum of the token-level scores); verl's "
        "acc and seq_final_reward are refused (not built yet)"))
    max_num_gen_batches: int = Field(0, ge=0, description=(
        "generation batches tried per step before giving up; 0 = no limit"))


def _bounds(text: str, field: str) -> tuple[float | None, float]:
    """``"upper"`` or ``"lower_upper"`` -> (lower or None, upper), both floats."""
    parts = text.strip().split("_")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2):
        raise ValueError(f"{field}: {text!r} is neither a number nor 'lower_upper' (e.g. "
                         "'0.5_2.0'; quote it in YAML)")
    return (None, values[0]) if len(values) == 1 else (values[0], values[1])


class RolloutCorrectionConfig(Section):
    """Off-policy correction between rollout-engine and trainer log-probs (verl's names).

    Convention: every bound here is on the ratio pi_old / mu itself. verl bounds -log(ratio)
    for its k1 rejection criteria: verl's k1 threshold "a_b" is megarl's
    "exp(-b)_exp(-a)" (verl 0.5_2.0 is not a ratio band)."""

    rollout_is: Literal["token", "sequence"] | None = Field(None, description=(
        "importance-sampling weights pi_old / mu per token or per sequence; null = off "
        "(metrics are still logged). Left unset with rollout.quantization=fp8 it is token "
        "(truncated IS at rollout_is_threshold): FP8 generation widens the engine/trainer "
        "mismatch; an explicit null keeps it off"))
    rollout_is_threshold: float | str = Field(2.0, description=(
        "a number: the weights are truncated at it (TIS); 'lower_upper' (e.g. '0.5_2.0', "
        "quoted): IcePop, weights whose ratio lies outside [lower, upper] are set to 0 and the "
        "others kept untruncated"))
    rollout_is_batch_normalize: bool = Field(False, description=(
        "divide the weights by their mean over the batch's valid tokens (per sequence at "
        "sequence level), so that they average 1; logs `rollout_corr/"
        "rollout_is_batch_norm_factor`"))
    rollout_rs: str | None = Field(None, description=(
        "rejection sampling criteria, comma-separated (token_k1, seq_mean_k3, seq_max_k2, "
        "...; a token is kept only if every one keeps it); null = off"))
    rollout_rs_threshold: float | str | None = Field(None, description=(
        "bounds of the rejection criteria: one number for all, or a comma-separated string "
        "with one entry per criterion, each 'upper' or (k1 only) 'lower_upper'. For *_k1 the "
        "bounds are on the ratio pi_old / mu (megarl's convention; verl bounds -log ratio, so "
        "verl's k1 'a_b' is megarl's 'exp(-b)_exp(-a)'); for k2/k3 an upper bound on the "
        "divergence"))
    rollout_rs_threshold_lower: float | None = Field(None, gt=0, description=(
        "*_k1 with a bare-number threshold: lower ratio bound; null = 1 / the upper one"))
    bypass_mode: bool = Field(False, description=(
        "use the rollout log-probs as the PPO anchor and skip the old-log-prob forward"))

    @field_validator("rollout_is_threshold")
    @classmethod
    def _is_band(cls, value: float | str) -> float | str:
        """A positive number or a 'lower_upper' band with 0 <= lower < upper."""
        lower, upper = (None, value) if not isinstance(value, str) else _bounds(
            value, "rollout_is_threshold")
        if upper <= 0 or (lower is not None and not 0 <= lower < upper):
            raise ValueError(f"rollout_is_threshold: need upper > 0 and 0 <= lower < upper, "
                             f"got {value!r}")
        return value

    @field_validator("rollout_rs")
    @classmethod
    def _known_criteria(cls, value: str | None) -> str | None:
        """Every comma-separated criterion is one of verl's."""
        if value is None:
            return None
        criteria = [c.strip() for c in value.split(",") if c.strip()]
        unknown = [c for c in criteria if c not in typing.get_args(RolloutRS)]
        if unknown or not criteria:
            raise ValueError(f"rollout_rs: unknown criteria {unknown or value!r}; valid: "
                             f"{', '.join(typing.get_args(RolloutRS))}")
        return ",".join(criteria)

    def is_bounds(self) -> tuple[float | None, float]:
        """(lower or None, upper) of the IS weights."""
        if isinstance(self.rollout_is_threshold, str):
            return _bounds(self.rollout_is_threshold, "rollout_is_threshold")
        return None, float(self.rollout_is_threshold)

    def rs_criteria(self) -> list[str]:
        """The rejection criteria in order (empty when off)."""
        return self.rollout_rs.split(",") if self.rollout_rs else []

    def rs_bounds(self) -> list[tuple[float | None, float]]:
        """(lower or None, upper) per rejection criterion; an unset threshold reads as 2.0."""
        criteria, threshold = self.rs_criteria(), self.rollout_rs_threshold
        if threshold is None or not isinstance(threshold, str):
            upper = 2.0 if threshold is None else float(threshold)
            return [(self.rollout_rs_threshold_lower, upper)] * len(criteria)
        entries = [_bounds(t, "rollout_rs_threshold") for t in threshold.split(",")]
        return entries * len(criteria) if len(entries) == 1 else entries


class AlgorithmConfig(Section):
    """Advantage estimation, reward-side KL, dynamic sampling and rollout correction."""

    adv_estimator: Literal["grpo", "grpo_passk", "rloo", "opo", "gpg", "reinforce_plus_plus",
                           "reinforce_plus_plus_baseline", "remax", "gae"] = Field(
        "grpo", description=(
            "advantage estimator: grpo (group-normalised), grpo_passk (only each group's best "
            "sample, credited r_max - r_second), rloo (leave-one-out), opo (length-weighted "
            "group mean as baseline), gpg (group-centred, scaled by B / (B - M) for the M "
            "samples of groups without reward spread), reinforce_plus_plus (discounted "
            "returns-to-go of the token rewards, whitened over the batch), "
            "reinforce_plus_plus_baseline (group-centred, whitened over the batch), gae (needs "
            "the critic); remax (greedy-rollout baseline) is refused: the greedy baseline "
            "rollout is not built"))
    norm_adv_by_std_in_grpo: bool = Field(True, description=(
        "grpo, grpo_passk: divide by the group's reward std (false = Dr. GRPO)"))
    gamma: float = Field(1.0, ge=0, le=1, description="discount factor (gae, reinforce++)")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda")
    use_kl_in_reward: bool = Field(False, description=(
        "subtract beta x KL(old || ref) per response token from the reward (the score sits on "
        "the last token; grpo/rloo use the sum per response, gae the tokens); turns the "
        "reference model on; logs `actor/reward_kl_penalty` and `actor/reward_kl_penalty_coeff`"))
    kl_penalty: KLType = Field("kl", description=(
        "KL estimator of the in-reward penalty (`full` is refused: it needs the logits)"))
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig, description=(
        "in-reward KL coefficient controller"))
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig, description=(
        "DAPO dynamic sampling"))
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig, description="rollout/trainer mismatch correction")


class SchedulerConfig(Section):
    """How rollout and training overlap, and how stale a sample may be."""

    mode: Literal["colocate_sync", "one_step_off", "fully_async"] = Field(
        "colocate_sync", description=(
            "colocate_sync = generate then train; one_step_off = train step k while generating "
            "k+1 (separate pools, staleness <= 1); fully_async = engines generate continuously "
            "into a bounded queue that the trainer consumes (separate pools)"))
    staleness_threshold: float = Field(0.1, ge=0, description=(
        "fully_async: how far generation may run ahead of training, in weight pushes: at most "
        "(1 + threshold) x the groups consumed per push are generated per push (verl's "
        "fraction of extra samples), and the newest tokens of a consumed group (a prompt's "
        "rollout.n samples) are at most ceil(threshold) pushes old (older groups are dropped, "
        "counted in fully_async/count/stale_dropped, and replaced). A group is as fresh as its "
        "newest segment: tokens generated before a push (a partial rollout resumed after it, a "
        "sibling that finished while a long one went on) may be older, keep their own weight "
        "versions and engine log-probs (with algorithm.rollout_correction.rollout_is on, "
        "importance weights correct for them) and count in "
        "staleness/*, which is by each sample's oldest token; bounding the oldest token "
        "instead would drop exactly the groups with samples long enough to span pushes and "
        "bias training to short responses. 0 with trigger_parameter_sync_step=1 = on-policy, "
        "equal to "
        "colocate_sync"))
    trigger_parameter_sync_step: int = Field(4, ge=1, description=(
        "fully_async: trainer steps (each consumes data.train_batch_size prompts' groups; set "
        "it equal to actor.ppo_mini_batch_size for one optimizer update per step) between two "
        "weight pushes to the engines"))
    partial_rollout: bool = Field(True, description=(
        "fully_async: at a weight push, pause in-flight requests (their tokens so far are "
        "kept) and continue them under the new weights, recording each token's weight version; "
        "false = stop starting requests and let those in flight finish before the push"))
    max_queue_length: int | None = Field(None, ge=1, description=(
        "fully_async: most samples queued or being generated ahead of the trainer; null = what "
        "the staleness bound allows, floor((1 + staleness_threshold) x "
        "trigger_parameter_sync_step x data.train_batch_size) x rollout.n"))


class PoolConfig(Section):
    """A set of GPUs (or, with `resources.device=cpu`, worker processes)."""

    nnodes: int = Field(1, ge=1, description="nodes in the pool")
    gpus_per_node: int = Field(8, ge=1, description=(
        "GPUs per node in the pool; on CPU, worker processes per node"))

    @property
    def world_size(self) -> int:
        """Total GPUs (or CPU worker processes) in the pool."""
        return self.nnodes * self.gpus_per_node


class ResourcesConfig(Section):
    """Where the roles run: the train pool, the rollout pool and the device kind."""

    train_pool: PoolConfig = Field(default_factory=PoolConfig, description=(
        "GPUs of the actor, reference and critic"))
    rollout_pool: PoolConfig | None = Field(None, description=(
        "GPUs of the rollout engines when `rollout.colocate` is false; null = the train pool"))
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description=(
        "auto = cuda when available; cpu runs every pool slot as one CPU process (gloo)"))
    gpu_memory_gb: float | None = Field(None, gt=0, description=(
        "memory of one GPU, used for the KV-cache and memory estimates; null = not estimated"))


class TrainerConfig(Section):
    """The run itself: length, outputs, checkpoints, logging, validation."""

    total_steps: int = Field(100, ge=1, description="RL steps to run")
    output_dir: str = Field("outputs/run", description=(
        "directory of checkpoints, logs and the saved resolved config"))
    save_every: int = Field(0, ge=0, description=(
        "checkpoint (actor model + optimizer + RNG, data position, step) every N steps and at "
        "the last step, under `output_dir/checkpoints`; 0 = only at the last step (none at all "
        "with `resume=never`)"))
    resume: str = Field("auto", description=(
        "auto = continue from the latest checkpoint under output_dir/checkpoints if any; never "
        "= start over; or a checkpoint directory"))
    keep_last: int | None = Field(None, ge=1, description=(
        "checkpoints kept on disk; null = all (a critic keeps one more: a crash between its "
        "save and the actor's resumes from the actor's previous step)"))
    async_save: bool = Field(False, description=(
        "write the actor's checkpoints in the background: the step waits only while the state "
        "is staged in host memory, a forked process per rank writes the files, and the "
        "checkpoint is published (renamed, `latest` moved) at the start of the next step's "
        "training, or at the end of the run; until then `latest` names the previous one. "
        "false = write and publish before the next step starts. The critic's are always "
        "written at once"))
    loggers: list[Literal["console", "jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["console", "jsonl"], description="metric trackers")
    project_name: str = Field("megarl", description="tracker project name")
    experiment_name: str = Field("run", description="tracker run name")
    wandb_proxy: str | None = Field(None, description=(
        "HTTP(S) proxy used by the wandb tracker only (never by engine traffic)"))
    worker_group: Literal["ray", "naive"] = Field("ray", description=(
        "ray = Ray actors on placement groups; naive = every role in one torchrun process group "
        "(debugging without Ray)"))
    val_every: int = Field(0, ge=0, description=(
        "validate every N steps (greedy, one sample per prompt of data.val_files); 0 = never"))
    phase_timeout_s: float = Field(3600.0, gt=0, description=(
        "time limit of each collective phase (generate, log-prob, update, weight sync); on "
        "timeout the run stops naming the phase and the ranks that did not finish. A weight "
        "sync also stops at once when an engine refuses a bucket; fully_async stops when no "
        "sample group within the staleness bound arrived for this long"))
    seed: int = Field(1, description="seed of model init, sampling and dropout")
    max_nonfinite_updates: int = Field(3, ge=0, description=(
        "stop the run after this many actor updates in a row were skipped for a non-finite "
        "loss or gradient, naming the step and the batch's first prompts (each skipped update "
        "keeps the last good weights and logs a warning); 0 = never stop"))
    preflight: bool = Field(True, description=(
        "on GPUs, before any worker starts, hold every phase's memory estimate (`megarl config "
        "show`) against each visible GPU's free memory, and with Ray each node's host-memory "
        "estimate (offloaded state, released engine weights, processes) against its available "
        "memory; refuse a run that cannot fit (exit 2, one line per phase or node with the "
        "fields that lower it); false = skip the checks"))


class RewardConfig(Section):
    """Rule-based reward computation."""

    function: str | None = Field(None, description=(
        "'package.module:callable' or 'path/to/file.py:callable' with verl's compute_score "
        "signature; null = megarl's built-in rewards chosen by the sample's data_source"))
    batched: bool = Field(False, description=(
        "call reward.function once per chunk of samples with plural argument names"))
    format_score: float = Field(0.0, description=(
        "reward of a well-formatted but wrong answer for the built-in synthetic tasks"))
    timeout_s: float = Field(30.0, gt=0, description="time limit per scored sample")
    num_workers: int = Field(4, ge=0, description=(
        "parallel reward processes; 0 = score in the driver process (debugging, no timeouts)"))

    @field_validator("function")
    @classmethod
    def _module_colon_callable(cls, value: str | None) -> str | None:
        """Require the ``package.module:function`` or ``path/to/file.py:function`` form."""
        if value is not None and not re.fullmatch(r"(?:[\w.]+|.+\.py):[\w.]+", value):
            raise ValueError(f"{value!r} is not of the form 'package.module:function' or "
                             "'path/to/file.py:function'")
        return value


class RayConfig(Section):
    """How the driver joins or starts Ray."""

    address: str | None = Field(None, description=(
        "null = attach to the Ray instance running on this node, else start one; 'local' = "
        "always start a private instance; 'auto' or host:port = attach to a running cluster"))
    num_cpus: int | None = Field(None, ge=1, description=(
        "CPUs Ray may use on this node (set from the Slurm allocation); null = Ray's detection"))
    timeline_file: str | None = Field(None, description=(
        "write a Ray timeline (chrome trace) here at the end of the run"))


# Fields whose null means "follow another field"; RunConfig fills them when it is built.
DERIVED_FIELDS: tuple[str, ...] = (
    "model.tokenizer_path", "actor.log_prob_micro_batch_size_per_gpu",
    "actor.log_prob_max_token_len_per_gpu", "ref.enabled", "ref.parallel",
    "ref.log_prob_micro_batch_size_per_gpu", "ref.log_prob_max_token_len_per_gpu",
    "critic.enabled",
    "critic.model_path", "critic.ppo_mini_batch_size", "critic.ppo_micro_batch_size_per_gpu",
    "critic.ppo_epochs", "critic.parallel", "rollout.enable_return_routed_experts",
    "rollout.dtype", "actor.offload.grad_offload", "actor.offload.optimizer_offload",
    "critic.offload.grad_offload", "critic.offload.optimizer_offload",
)


class RunConfig(Section):
    """A whole megarl run. Load it with :func:`megarl.config.load_config`."""

    model: ModelConfig = Field(description="the policy model")
    data: DataConfig = Field(description="prompt data and prompts per step")
    actor: ActorConfig = Field(default_factory=ActorConfig, description="the trained policy")
    ref: RefConfig = Field(default_factory=RefConfig, description="the reference policy")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="the value model")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="generation")
    checkpoint_engine: CheckpointEngineConfig = Field(
        default_factory=CheckpointEngineConfig, description="weight streaming to the engines")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig,
                                       description="the RL algorithm")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description=(
        "overlap of rollout and training"))
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig, description="GPU pools")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="the run")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="reward functions")
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray start-up")

    @model_validator(mode="after")
    def _fill_derived(self) -> RunConfig:
        """Replace each null of DERIVED_FIELDS by the value it follows."""
        actor = self.actor
        self.model.tokenizer_path = self.model.tokenizer_path or self.model.path
        if actor.log_prob_micro_batch_size_per_gpu is None:
            actor.log_prob_micro_batch_size_per_gpu = actor.ppo_micro_batch_size_per_gpu
        if actor.log_prob_max_token_len_per_gpu is None:
            actor.log_prob_max_token_len_per_gpu = actor.ppo_max_token_len_per_gpu
        if self.ref.enabled is None:
            self.ref.enabled = actor.use_kl_loss or self.algorithm.use_kl_in_reward
        if self.ref.parallel is None:
            self.ref.parallel = actor.parallel.model_copy()
        if self.ref.log_prob_micro_batch_size_per_gpu is None:
            self.ref.log_prob_micro_batch_size_per_gpu = actor.log_prob_micro_batch_size_per_gpu
        if self.ref.log_prob_max_token_len_per_gpu is None:
            self.ref.log_prob_max_token_len_per_gpu = actor.log_prob_max_token_len_per_gpu
        self._fill_critic()
        if self.rollout.enable_return_routed_experts is None:
            self.rollout.enable_return_routed_experts = actor.router_replay.mode == "R3"
        if self.rollout.dtype is None:
            self.rollout.dtype = self.model.dtype
        correction = self.algorithm.rollout_correction
        if self.rollout.quantization == "fp8" and "rollout_is" not in correction.model_fields_set:
            correction.rollout_is = "token"  # FP8 rollout: truncated IS unless set (docs/fp8.md)
        for offload in (actor.offload, self.critic.offload):  # colocated: off the GPU
            if offload.grad_offload is None:
                offload.grad_offload = self.rollout.colocate
            if offload.optimizer_offload is None:
                offload.optimizer_offload = self.rollout.colocate
        return self

    def _fill_critic(self) -> None:
        """Critic fields that follow the actor's."""
        critic, actor = self.critic, self.actor
        if critic.enabled is None:
            critic.enabled = self.algorithm.adv_estimator == "gae"
        critic.model_path = critic.model_path or self.model.path
        if critic.ppo_mini_batch_size is None:
            critic.ppo_mini_batch_size = actor.ppo_mini_batch_size
        if critic.ppo_micro_batch_size_per_gpu is None:
            critic.ppo_micro_batch_size_per_gpu = actor.ppo_micro_batch_size_per_gpu
        if critic.ppo_epochs is None:
            critic.ppo_epochs = actor.ppo_epochs
        if critic.parallel is None:
            critic.parallel = actor.parallel.model_copy()


__all__ = [
    "DERIVED_FIELDS",
    "ActorConfig",
    "AlgorithmConfig",
    "CheckpointEngineConfig",
    "CriticConfig",
    "DataConfig",
    "FilterGroupsConfig",
    "KLControlConfig",
    "ModelConfig",
    "OffloadConfig",
    "OptimConfig",
    "ParallelConfig",
    "PoolConfig",
    "RayConfig",
    "RefConfig",
    "ResourcesConfig",
    "RewardConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RunConfig",
    "SchedulerConfig",
    "TrainerConfig",
]
