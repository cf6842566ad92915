"""Config sections of the train side: the model, the prompt data, the actor, the reference model
and the critic. Key names follow verl's where the concept is the same."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from megarl.config.lora_layers import LoraTarget
from megarl.config.schema_common import Dtype, OffloadConfig, OptimConfig, ParallelConfig, Section

LossAggMode = Literal[
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]
# verl's KL estimators; a "+" suffix uses straight-through k2 gradients with the named value.
KLType = Literal[
    "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full",
    "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+",
]


class ModelConfig(Section):
    """The policy model: an HF model directory, loaded directly through the bridge."""

    path: str = Field(description=(
        "local HF model directory (config.json + safetensors); its architecture is checked "
        "against the parallel layout"))
    tokenizer_path: str | None = Field(None, description=(
        "tokenizer directory; null = `path`"))
    dtype: Dtype = Field("bfloat16", description=(
        "training parameter dtype (Megatron keeps fp32 master weights in the optimizer)"))
    trust_remote_code: bool = Field(False, description=(
        "allow custom modelling code shipped with the model (HF `trust_remote_code`)"))
    mcore_checkpoint: str | None = Field(None, description=(
        "megatron dist checkpoint to take the actor's (and reference's) first weights from "
        "instead of the safetensors in `path` (written by `megarl-convert hf-to-mcore` or a "
        "megarl training checkpoint; any TP/PP/EP layout); `path` still gives config and "
        "tokenizer"))


class DataConfig(Section):
    """Prompt datasets (parquet/jsonl in verl's schema) and the batch of prompts per step."""

    train_files: list[str] = Field(min_length=1, description=(
        "training prompt files (parquet or jsonl); each must exist and be readable before any "
        "worker starts"))
    val_files: list[str] = Field(default_factory=list, description=(
        "validation prompt files; needed when `trainer.val_every` > 0"))
    prompt_key: str = Field("prompt", description="column that holds the chat-format prompt")
    max_prompt_length: int = Field(512, ge=1, description="longest prompt in tokens")
    max_response_length: int = Field(1024, ge=1, description=(
        "most tokens generated per response; with `rollout.multi_turn` the budget of the "
        "whole episode after the prompt (model and environment tokens)"))
    train_batch_size: int = Field(64, ge=1, description=(
        "prompts per RL step; each gets `rollout.n` responses"))
    val_batch_size: int | None = Field(None, ge=1, description=(
        "prompts per validation batch; null = the whole validation set at once"))
    shuffle: bool = Field(True, description="shuffle the training prompts every epoch")
    seed: int = Field(1, description="seed of the prompt shuffling")

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_file_is_a_list(cls, value: object) -> object:
        """Accept a single path where a list of paths is expected (as verl does)."""
        return [value] if isinstance(value, str) else value


class PolicyLossConfig(Section):
    """Which policy-gradient objective the actor minimises, and the options of some of them."""

    loss_mode: Literal["vanilla", "gspo", "cispo", "clip_cov", "kl_cov", "geo_mean", "sapo",
                       "gpg", "dppo_tv", "dppo_kl"] = Field("vanilla", description=(
        "vanilla = PPO clipped token ratio (dual clip `actor.clip_ratio_c`); gspo = "
        "sequence-level (length-normalised) ratio; cispo = clipped, detached IS weight times "
        "log-prob (MiniMax-M1); clip_cov / kl_cov = PPO with a random set of high-covariance "
        "tokens detached / unclipped with a |log-ratio| penalty on the highest-covariance "
        "tokens; geo_mean = GMPO, the geometric mean of the token ratios clipped in log space "
        "(`actor.clip_ratio_low/high` are log bounds; the paper uses 0.4); sapo = soft "
        "sigmoid gate (`actor.tau_pos/tau_neg`); gpg = plain -A log-prob; dppo_tv / dppo_kl = "
        "tokens outside a binary total-variation / KL trust region are dropped "
        "(`actor.clip_ratio_low/high` are the divergence thresholds, `actor.clip_ratio_c` "
        "truncates the IS ratio; the paper recommends a large one). gspo and geo_mean need "
        "`actor.loss_agg_mode=seq-mean-token-mean`"))
    clip_cov_ratio: float = Field(2e-4, gt=0, description=(
        "clip_cov: fraction of a micro-batch's tokens detached"))
    clip_cov_lb: float = Field(1.0, description=(
        "clip_cov: only tokens with covariance above this are candidates"))
    clip_cov_ub: float = Field(5.0, description=(
        "clip_cov: only tokens with covariance below this are candidates"))
    kl_cov_ratio: float = Field(2e-4, gt=0, description=(
        "kl_cov: fraction of a micro-batch's tokens (largest covariance) penalised"))
    ppo_kl_coef: float = Field(1.0, ge=0, description=(
        "kl_cov: coefficient of the |log-ratio| penalty"))


class RecomputeConfig(Section):
    """Activation recomputation of the Megatron model (trades compute for memory)."""

    granularity: Literal["none", "selective", "full"] = Field("none", description=(
        "none, selective (the submodules in `modules`) or full (whole layers)"))
    method: Literal["uniform", "block"] = Field("uniform", description=(
        "full recompute only: uniform = every `num_layers` layers as one unit; block = the "
        "first `num_layers` layers of each pipeline stage"))
    num_layers: int = Field(1, ge=1, description="full recompute only: layers per unit / block")
    modules: list[Literal["core_attn", "mlp", "moe"]] = Field(
        default_factory=lambda: ["core_attn"], description=(
            "selective recompute only: core_attn = the attention core (with the fused/SDPA "
            "attention of both specs it keeps little beyond q, k, v), mlp = the dense MLPs, "
            "moe = the MoE layers (megatron's `recompute_modules`)"))


class RouterReplayConfig(Section):
    """MoE router replay: train on the experts the rollout (R3) or old policy (R2) chose."""

    mode: Literal["disabled", "R2", "R3"] = Field("disabled", description=(
        "R2 = record routes in the old-log-prob forward and replay them in the update; "
        "R3 = replay the routes returned by the rollout engine in both (needs a MoE model)"))
    diagnose_no_replay: bool = Field(False, description=(
        "R3 only: also run the old-log-prob forward without replay, for the metrics "
        "`rollout/moe/router_agreement_no_replay` and `training/rollout_probs_diff_no_replay_*`; "
        "costs one more forward over the whole batch every step (about as long as the "
        "old-log-prob forward itself)"))


class LoraConfig(Section):
    """LoRA: train low-rank adapters on the actor's linear layers, the base model frozen."""

    rank: int = Field(0, ge=0, description=(
        "adapter rank r; 0 = off (full fine-tuning). With r > 0 the base weights stay frozen in "
        "`model.dtype` (no gradients, no optimizer state) and only the adapters train, under "
        "megatron's optimizer with fp32 master copies; the weight sync sends the merged weights "
        "W + alpha/r * B A under the HF names. The actor runs megarl's native layer spec"))
    alpha: float = Field(16.0, gt=0, description=(
        "the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)"))
    dropout: float = Field(0.0, ge=0, lt=1, description=(
        "dropout on the adapters' input in the update's forwards (PEFT's lora_dropout); the "
        "log-prob forwards run without it"))
    target_modules: list[LoraTarget] | None = Field(None, min_length=1, description=(
        "megatron's linear layers that get adapters: linear_qkv (one adapter each for q, k and "
        "v, as PEFT's q_proj/k_proj/v_proj), linear_proj (o_proj), linear_fc1 (gate_proj and "
        "up_proj) and linear_fc2 (down_proj) of the dense MLPs, "
        "shared_experts.linear_fc1/linear_fc2 of the MoE layers' shared expert, "
        "experts.linear_fc1/linear_fc2 of the routed experts (one adapter per expert, PEFT's "
        "layout of HF's fused expert tensors; needs dropout 0 and parallel.etp 1 or = tp); "
        "each must select "
        "a layer of the model. null = every one of them the model has but the routed experts'"))
    exclude_modules: list[str] = Field(default_factory=list, description=(
        "targeted layers left without adapters: fnmatch patterns over layers.{i}.{path} with "
        "the global layer index i, e.g. layers.0.self_attention.linear_qkv, layers.1.*, "
        "*.linear_proj; each must match a targeted layer"))
    sync: Literal["merged", "adapter"] = Field("merged", description=(
        "what the weight sync sends: merged = W + alpha/r * B A under the HF names (any engine; "
        "in bf16 or fp16 the rounding loses much of the adapters' early change, so validation "
        "warns unless algorithm.rollout_correction.rollout_is is set); "
        "adapter = only the adapters, in PEFT's names (the routed experts' one per expert, "
        "experts.{e}.gate_proj/up_proj/down_proj, as SGLang loads MoE adapters), through "
        "SGLang's /load_lora_adapter_from_tensors (a new name per version, the previous one "
        "unloaded; every request names it with lora_path); the engines keep model.path as the "
        "base, so model.mcore_checkpoint is refused. Engines start with --enable-lora (SGLang "
        "also with --max-lora-rank and --lora-target-modules) and, colocated, with "
        "--enable-weights-cpu-backup: the base waits in host memory while the actor trains, "
        "where a merged sync's engines drop it. Every scheduler syncs between "
        "generations, so no request in flight uses the adapter unloaded"))


class ActorConfig(Section):
    """The policy being trained: batch split, PPO loss, optimizer and Megatron layout."""

    ppo_mini_batch_size: int = Field(16, ge=1, description=(
        "prompts per optimizer step (multiplied by `rollout.n` into sequences); must divide "
        "`data.train_batch_size`"))
    ppo_micro_batch_size: int | None = Field(None, ge=1, description=(
        "global micro-batch in sequences, split over DP ranks (verl's deprecated form); "
        "mutually exclusive with `ppo_micro_batch_size_per_gpu`"))
    ppo_micro_batch_size_per_gpu: int | None = Field(None, ge=1, description=(
        "sequences per forward/backward on one DP rank; required unless `use_dynamic_bsz`"))
    use_dynamic_bsz: bool = Field(False, description=(
        "pack micro-batches by token budget (`ppo_max_token_len_per_gpu`) instead of a fixed "
        "number of sequences"))
    ppo_max_token_len_per_gpu: int = Field(16384, ge=1, description=(
        "dynamic batch size: tokens per micro-batch per GPU (scaled by cp); must hold one "
        "sequence of max_prompt_length + max_response_length"))
    log_prob_max_token_len_per_gpu: int | None = Field(None, ge=1, description=(
        "dynamic batch size: tokens per GPU (scaled by cp) of one forward of the old-log-prob "
        "pass (and of the reference's, unless ref.log_prob_max_token_len_per_gpu): a forward "
        "keeps no activations for a backward, so it fits more tokens than an update "
        "micro-batch, in fewer, larger matmuls (verl's rollout.log_prob_max_token_len_per_gpu; "
        "the preflight checks its memory as phase old_log_prob); must hold one sequence of "
        "max_prompt_length + max_response_length; null = `ppo_max_token_len_per_gpu`"))
    ppo_epochs: int = Field(1, ge=1, description="passes over each step's samples")
    clip_ratio_low: float = Field(0.2, ge=0, description=(
        "PPO clip below: ratio >= 1 - clip_ratio_low"))
    clip_ratio_high: float = Field(0.2, ge=0, description=(
        "PPO clip above: ratio <= 1 + clip_ratio_high (raise it for DAPO clip-higher)"))
    clip_ratio_c: float = Field(3.0, gt=1, description=(
        "dual-clip bound for negative advantages; dppo_tv/dppo_kl: the IS-ratio truncation"))
    loss_agg_mode: LossAggMode = Field("token-mean", description=(
        "how token losses are averaged (actor, and the critic's value loss); token-mean "
        "avoids GRPO's length bias; seq-mean-token-sum-norm divides each sequence's sum by "
        "`data.max_response_length` and takes the mean over sequences (Dr. GRPO; verl does not "
        "divide by the number of sequences)"))
    tau_pos: float = Field(1.0, gt=0, description=(
        "sapo: gate temperature of tokens with positive advantage"))
    tau_neg: float = Field(1.05, gt=0, description=(
        "sapo: gate temperature of tokens with zero or negative advantage"))
    entropy_coeff: float = Field(0.0, ge=0, description="entropy bonus coefficient")
    use_kl_loss: bool = Field(False, description=(
        "add a KL(policy || reference) term to the loss; turns the reference model on"))
    kl_loss_coef: float = Field(0.001, ge=0, description="coefficient of the KL loss")
    kl_loss_type: KLType = Field("low_var_kl", description=(
        "KL estimator: kl/k1, abs, mse/k2, low_var_kl/k3, full; '+' suffix = k2 gradients"))
    policy_loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig, description=(
        "policy-gradient objective"))
    grad_clip: float = Field(1.0, ge=0, description=(
        "gradient-norm clipping threshold; 0 turns clipping off"))
    optim: OptimConfig = Field(default_factory=OptimConfig, description="optimizer and schedule")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description=(
        "Megatron parallel layout"))
    use_distributed_optimizer: bool = Field(True, description=(
        "shard optimizer states over data-parallel ranks (Megatron distributed optimizer)"))
    offload: OffloadConfig = Field(default_factory=OffloadConfig, description=(
        "host-memory offload between phases"))
    recompute: RecomputeConfig = Field(default_factory=RecomputeConfig, description=(
        "activation recomputation of the actor, and of the critic, which follows it (the "
        "reference model only runs forwards without gradients)"))
    router_replay: RouterReplayConfig = Field(default_factory=RouterReplayConfig, description=(
        "MoE router replay"))
    lora: LoraConfig = Field(default_factory=LoraConfig, description=(
        "LoRA adapters instead of full fine-tuning"))
    cuda_graphs: bool = Field(False, description=(
        "replay each training micro-batch's forward and backward from CUDA graphs captured per "
        "token bucket (GPU; needs parallel.pp=1, no router replay, no dropout); pays when the "
        "step is bound by kernel launches, as with small or MoE models. Micro-batches of one or "
        "several packed sequences are captured (H200); a capture that fails anyway runs that "
        "update eagerly, with a warning"))
    cuda_graph_bucket_tokens: int = Field(1024, ge=1, description=(
        "with `cuda_graphs`: micro-batches are padded up to a multiple of this many tokens, "
        "one pair of graphs per multiple (at most 8, later shapes run eagerly)"))
    log_prob_micro_batch_size_per_gpu: int | None = Field(None, ge=1, description=(
        "sequences per forward when recomputing old log-probs: micro-batches are packed up to "
        "this many x (max_prompt_length + max_response_length) tokens, as training packs by "
        "`ppo_micro_batch_size_per_gpu`; null = the training micro-batch; with `use_dynamic_bsz` "
        "the forward packs by `ppo_max_token_len_per_gpu` instead"))


class RefOffloadConfig(Section):
    """Offload of the reference model (it has no gradients or optimizer)."""

    param_offload: bool = Field(False, description=(
        "keep reference parameters in host memory (pinned) between its forwards"))


class RefConfig(Section):
    """The frozen reference policy used by KL terms."""

    enabled: bool | None = Field(None, description=(
        "null = on when `actor.use_kl_loss` or `algorithm.use_kl_in_reward` is set"))
    parallel: ParallelConfig | None = Field(None, description=(
        "Megatron layout of the reference: it is built in the actor's workers, so it must equal "
        "the actor's (anything else is refused); null = the actor's"))
    offload: RefOffloadConfig = Field(default_factory=RefOffloadConfig, description=(
        "host-memory offload"))
    log_prob_micro_batch_size_per_gpu: int | None = Field(None, ge=1, description=(
        "sequences per reference forward, packed as the actor's log-prob forward; null = the "
        "actor's log-prob micro-batch"))
    log_prob_max_token_len_per_gpu: int | None = Field(None, ge=1, description=(
        "with actor.use_dynamic_bsz: tokens per GPU of one reference forward; null = "
        "actor.log_prob_max_token_len_per_gpu"))


class CriticConfig(Section):
    """The value model, used by GAE."""

    enabled: bool | None = Field(None, description=(
        "null = on when `algorithm.adv_estimator` is gae"))
    model_path: str | None = Field(None, description=(
        "HF directory the critic starts from; null = `model.path`"))
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5), description=(
        "optimizer and schedule (lr 1e-5 by default)"))
    ppo_mini_batch_size: int | None = Field(None, ge=1, description=(
        "prompts per critic optimizer step; null = the actor's"))
    ppo_micro_batch_size_per_gpu: int | None = Field(None, ge=1, description=(
        "sequences per forward/backward per DP rank; null = the actor's"))
    ppo_epochs: int | None = Field(None, ge=1, description="null = the actor's")
    cliprange_value: float = Field(0.5, gt=0, description="value-function clip range")
    grad_clip: float = Field(1.0, ge=0, description="gradient-norm clip; 0 turns it off")
    parallel: ParallelConfig | None = Field(None, description=(
        "Megatron layout of the critic; null = the actor's"))
    offload: OffloadConfig = Field(default_factory=OffloadConfig, description=(
        "host-memory offload"))
