"""Validation rules of the parallel layout against the pools and the model's own architecture
(PITFALLS B3, B4, B5): Megatron TP/PP/VPP/EP/ETP/CP on the train pool, engines on the rollout
pool. Each rule is a generator of :class:`Problem`; ``LAYOUT_RULES`` lists them in order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from megarl.config.derived import divisors, kv_cache_sequences, nearest_divisor, rollout_pool_gpus
from megarl.config.problems import Context, Problem, error, warning
from megarl.config.schema import ParallelConfig

Rule = Callable[[Context], Iterator[Problem]]


def _pick(options: list[int], target: int) -> int | None:
    """The option closest to ``target`` (smaller on a tie); None when there is none."""
    return min(options, key=lambda d: (abs(d - target), d)) if options else None


def _tp_options(ctx: Context, p: ParallelConfig) -> list[int]:
    """TP sizes that fit the train pool with this pp x cp and the model's heads."""
    world = ctx.cfg.resources.train_pool.world_size
    model = ctx.model
    return [d for d in divisors(world) if world % (d * p.pp * p.cp) == 0 and (
        model is None or (model.num_attention_heads % d == 0 and (
            model.num_kv_heads % d == 0 or d % model.num_kv_heads == 0)))]


def check_layout_fills_train_pool(ctx: Context) -> Iterator[Problem]:
    """tp x pp x cp must divide the train pool, leaving a whole data-parallel size >= 1."""
    world = ctx.cfg.resources.train_pool.world_size
    for role, p in ctx.roles():
        model_size = p.tp * p.pp * p.cp
        if world % model_size == 0:
            continue
        choices = {"tp": _pick(_tp_options(ctx, p), p.tp)}
        for dim, others in (("pp", p.tp * p.cp), ("cp", p.tp * p.pp)):
            if getattr(p, dim) > 1:
                choices[dim] = _pick([d for d in divisors(world) if world % (d * others) == 0],
                                     getattr(p, dim))
        fixes = [f"{role}.parallel.{dim}={value}" for dim, value in choices.items()
                 if value is not None and (dim == "tp" and p.tp > 1 or dim != "tp")]
        fix = "use " + " or ".join(fixes) if fixes else f"use {role}.parallel.tp={choices['tp']}"
        pool = math.ceil(world / model_size) * model_size
        yield error((f"{role}.parallel.tp", f"{role}.parallel.pp", f"{role}.parallel.cp",
                     "resources.train_pool"),
                    f"tp {p.tp} x pp {p.pp} x cp {p.cp} = {model_size} does not divide the "
                    f"{world} {ctx.sizes.slot_name} of the train pool (data-parallel size would "
                    f"be {world / model_size:.2f})",
                    f"{fix}, or a train pool of {pool} {ctx.sizes.slot_name}")


def check_expert_layout(ctx: Context) -> Iterator[Problem]:
    """etp x ep x pp must divide the train pool (megatron-core: expert-data-parallel is whole)."""
    world = ctx.cfg.resources.train_pool.world_size
    for role, p in ctx.roles():
        size = p.expert_tp * p.ep * p.pp
        if world % size == 0:
            continue
        per_stage = world // p.pp if world % p.pp == 0 else 0
        experts = ctx.model.num_experts if ctx.model is not None else 0
        options = [d for d in divisors(per_stage) if per_stage % (d * p.expert_tp) == 0 and (
            not experts or experts % d == 0)]
        ep = _pick(options, p.ep)
        yield error((f"{role}.parallel.ep", f"{role}.parallel.etp", f"{role}.parallel.pp"),
                    f"etp {p.expert_tp}{' (= tp while etp is unset)' if p.etp is None else ''}"
                    f" x ep {p.ep} x pp {p.pp} = {size} does not divide the {world} "
                    f"{ctx.sizes.slot_name} of the train pool (expert-data-parallel size must be "
                    "whole)",
                    f"use {role}.parallel.ep={ep}" if ep else f"use {role}.parallel.etp=1 and "
                    f"an ep that divides {per_stage or world}")


def check_experts_divisible_by_ep(ctx: Context) -> Iterator[Problem]:
    """The routed experts must split evenly over ep; ep > 1 needs a MoE model."""
    model = ctx.model
    if model is None:
        return
    for role, p in ctx.roles():
        if p.ep == 1:
            continue
        if not model.is_moe:
            yield error(f"{role}.parallel.ep", f"ep={p.ep} but the model ({model.model_type}) "
                        f"has no routed experts", f"set {role}.parallel.ep=1")
        elif model.num_experts % p.ep:
            world = ctx.cfg.resources.train_pool.world_size
            fits = [d for d in divisors(model.num_experts) if world % (d * p.expert_tp * p.pp) == 0]
            ep = _pick(fits, p.ep) or nearest_divisor(model.num_experts, p.ep)
            yield error(f"{role}.parallel.ep", f"the model's {model.num_experts} experts do not "
                        f"split over ep={p.ep}", f"use {role}.parallel.ep={ep}")


def check_heads_divisible_by_tp(ctx: Context) -> Iterator[Problem]:
    """Attention heads must split evenly over tp (megatron-core's rule)."""
    model = ctx.model
    if model is None:
        return
    for role, p in ctx.roles():
        if model.num_attention_heads % p.tp:
            tp = _pick(_tp_options(ctx, p), p.tp) or nearest_divisor(
                model.num_attention_heads, p.tp)
            yield error(f"{role}.parallel.tp", f"the model's {model.num_attention_heads} attention "
                        f"heads do not split over tp={p.tp}", f"use {role}.parallel.tp={tp}")


def check_kv_heads_vs_tp(ctx: Context) -> Iterator[Problem]:
    """KV heads (query groups) must be a multiple or a divisor of tp (megatron-core's rule)."""
    model = ctx.model
    if model is None:
        return
    kv = model.num_kv_heads
    for role, p in ctx.roles():
        if kv % p.tp and p.tp % kv:
            tp = _pick(_tp_options(ctx, p), p.tp) or 1
            yield error(f"{role}.parallel.tp", f"the model's {kv} KV heads are neither a multiple "
                        f"nor a divisor of tp={p.tp}", f"use {role}.parallel.tp={tp}")


def check_ffn_divisible(ctx: Context) -> Iterator[Problem]:
    """Expert FFN width must split over etp, dense FFN width over tp (column-parallel linears)."""
    model = ctx.model
    if model is None:
        return
    for role, p in ctx.roles():
        if model.is_moe and model.moe_ffn_hidden_size % p.expert_tp:
            etp = nearest_divisor(model.moe_ffn_hidden_size, p.expert_tp)
            yield error(f"{role}.parallel.etp", f"the expert FFN width {model.moe_ffn_hidden_size} "
                        f"does not split over etp={p.expert_tp}", f"use {role}.parallel.etp={etp}")
        if model.dense_layers and model.ffn_hidden_size % p.tp:
            tp = nearest_divisor(math.gcd(model.ffn_hidden_size, model.num_attention_heads), p.tp)
            yield error(f"{role}.parallel.tp", f"the dense FFN width {model.ffn_hidden_size} does "
                        f"not split over tp={p.tp}", f"use {role}.parallel.tp={tp}")


def check_layers_divisible_by_pp(ctx: Context) -> Iterator[Problem]:
    """Layers must split evenly over pp stages, and each stage's layers over vpp chunks."""
    for role, p in ctx.roles():
        if p.vpp is not None and p.pp == 1:
            yield error((f"{role}.parallel.vpp", f"{role}.parallel.pp"), "virtual pipeline stages "
                        "need pipeline parallelism (pp > 1)", f"remove {role}.parallel.vpp or set "
                        f"{role}.parallel.pp > 1")
            continue
        model = ctx.model
        if model is None:
            continue
        layers = model.num_layers
        if layers % p.pp:
            world = ctx.cfg.resources.train_pool.world_size
            fits = [d for d in divisors(layers) if world % (d * p.tp * p.cp) == 0]
            pp = _pick(fits, p.pp) or nearest_divisor(layers, p.pp)
            yield error(f"{role}.parallel.pp", f"the model's {layers} layers do not split over "
                        f"pp={p.pp}", f"use {role}.parallel.pp={pp}")
        elif p.vpp is not None and (layers // p.pp) % p.vpp:
            per_stage = layers // p.pp
            yield error(f"{role}.parallel.vpp", f"each pipeline stage has {per_stage} layers, "
                        f"which do not split into vpp={p.vpp} chunks",
                        f"use {role}.parallel.vpp={nearest_divisor(per_stage, p.vpp)}")


def check_moe_tp_sequence_parallel(ctx: Context) -> Iterator[Problem]:
    """megatron-core's MoE layer refuses tp > 1 without sequence parallelism in training."""
    if ctx.model is None or not ctx.model.is_moe:
        return
    for role, p in ctx.roles():
        if p.tp > 1 and not p.sequence_parallel and role != "ref":
            yield error(f"{role}.parallel.sequence_parallel", f"a MoE model with tp={p.tp} needs "
                        "sequence parallelism", f"set {role}.parallel.sequence_parallel=true")


def check_recompute_layers(ctx: Context) -> Iterator[Problem]:
    """Full recompute units must fit the layers of one pipeline chunk of the actor and of the
    critic (which follows ``actor.recompute``): block recomputes at most a chunk's layers,
    uniform cuts a chunk into whole units of ``num_layers``."""
    cfg, rc, model = ctx.cfg, ctx.cfg.actor.recompute, ctx.model
    if rc.granularity != "full" or model is None:
        return
    layouts = [("actor", cfg.actor.parallel)]
    critic = cfg.critic
    if critic.enabled and critic.model_path in (None, cfg.model.path) and (
            critic.parallel not in (None, cfg.actor.parallel)):
        layouts.append(("critic", critic.parallel))
    for role, p in layouts:
        if model.num_layers % (p.pp * (p.vpp or 1)):
            continue  # check_layers_divisible_by_pp reports it
        per_chunk = model.num_layers // p.pp // (p.vpp or 1)
        where = "" if role == "actor" else f" (the {role}'s layout)"
        if rc.method == "block" and rc.num_layers > per_chunk:
            yield error(("actor.recompute.num_layers", f"{role}.parallel.pp"),
                        f"block recompute of {rc.num_layers} layers, but a pipeline chunk"
                        f"{where} has {per_chunk}", f"use actor.recompute.num_layers={per_chunk}")
        elif rc.method == "uniform" and per_chunk % rc.num_layers:
            fit = nearest_divisor(per_chunk, rc.num_layers)
            yield error(("actor.recompute.num_layers", f"{role}.parallel.pp"),
                        f"uniform recompute units of {rc.num_layers} layers do not divide the "
                        f"{per_chunk} layers of a pipeline chunk{where}",
                        f"use actor.recompute.num_layers={fit}")


def check_recompute_modules(ctx: Context) -> Iterator[Problem]:
    """Selective recompute must name modules the model has: megatron skips the others."""
    rc, model = ctx.cfg.actor.recompute, ctx.model
    if rc.granularity != "selective":
        return
    if not rc.modules:
        yield error("actor.recompute.modules", "selective recompute of no module recomputes "
                    "nothing", "set actor.recompute.granularity=none or name modules")
    if model is None:
        return
    if "moe" in rc.modules and not model.is_moe:
        yield error("actor.recompute.modules", "moe: the model has no MoE layers",
                    "remove moe from actor.recompute.modules (use mlp)")
    if "mlp" in rc.modules and model.is_moe and not model.dense_layers:
        yield error("actor.recompute.modules", "mlp: every layer of the model is a MoE layer",
                    "use moe in actor.recompute.modules instead of mlp")


def check_context_parallel_sequence_length(ctx: Context) -> Iterator[Problem]:
    """With cp > 1 every sequence is cut into 2 x cp chunks: the longest must divide evenly."""
    data = ctx.cfg.data
    longest = data.max_prompt_length + data.max_response_length
    for role, p in ctx.roles():
        if p.cp > 1 and longest % (2 * p.cp):
            step = 2 * p.cp
            response = data.max_response_length + step - longest % step
            yield error((f"{role}.parallel.cp", "data.max_prompt_length",
                         "data.max_response_length"),
                        f"the longest sequence ({data.max_prompt_length} + "
                        f"{data.max_response_length} = {longest} tokens) is not divisible by "
                        f"2 x cp = {step}", f"set data.max_response_length={response}")


def check_context_parallel_combinations(ctx: Context) -> Iterator[Problem]:
    """Context parallelism is built for dense and MoE models with TP + SP, PP, EP, the critic
    and router replay (cp=2 equals cp=1 on gloo, tests/megatron/test_context_parallel.py); it is
    refused for what it is not built for: MLA models and CUDA-graphed updates."""
    for role, p in ctx.roles():
        if p.cp == 1:
            continue
        if ctx.model is not None and ctx.model.is_mla:
            yield error(f"{role}.parallel.cp", "context parallelism for multi-head latent "
                        "attention (DeepSeek-V2/V3) is not built yet",
                        f"set {role}.parallel.cp=1")
    if ctx.cfg.actor.cuda_graphs and ctx.cfg.actor.parallel.cp > 1:
        yield error(("actor.cuda_graphs", "actor.parallel.cp"), "CUDA-graphed updates capture "
                    "whole micro-batches; context parallelism splits them over ranks",
                    "set actor.cuda_graphs=false or actor.parallel.cp=1")


def check_vocab_and_tokenizer(ctx: Context) -> Iterator[Problem]:
    """Token ids must stay below the model's vocab size (ids >= vocab give NaN or index errors)."""
    from megarl.config.model_info import tokenizer_size

    if ctx.model is None or ctx.cfg.model.tokenizer_path is None:
        return
    size = tokenizer_size(ctx.cfg.model.tokenizer_path)
    if size is not None and size > ctx.model.vocab_size:
        yield error(("model.tokenizer_path", "model.path"), f"the tokenizer has token ids up to "
                    f"{size - 1} but config.json's vocab_size is {ctx.model.vocab_size}",
                    "use the tokenizer that belongs to the model")


def check_sequence_fits_positions(ctx: Context) -> Iterator[Problem]:
    """The longest sequence should fit the model's position range."""
    model, data = ctx.model, ctx.cfg.data
    if model is None or not model.max_position_embeddings:
        return
    longest = data.max_prompt_length + data.max_response_length
    if longest > model.max_position_embeddings:
        yield warning(("data.max_prompt_length", "data.max_response_length"),
                      f"the longest sequence ({longest} tokens) exceeds the model's "
                      f"max_position_embeddings {model.max_position_embeddings}",
                      f"keep max_prompt_length + max_response_length <= "
                      f"{model.max_position_embeddings}")


def check_engines_fill_rollout_pool(ctx: Context) -> Iterator[Problem]:
    """Engines of gpus_per_engine GPUs must tile the rollout pool."""
    gpus, per_engine = rollout_pool_gpus(ctx.cfg), ctx.cfg.rollout.gpus_per_engine
    if gpus is None:
        return
    pool = "resources.train_pool" if ctx.cfg.rollout.colocate else "resources.rollout_pool"
    if gpus % per_engine:
        yield error(("rollout.gpus_per_engine", pool), f"engines of {per_engine} GPUs do not tile "
                    f"the {gpus} {ctx.sizes.slot_name} of the rollout pool",
                    f"use rollout.gpus_per_engine={nearest_divisor(gpus, per_engine)}")
    pool_cfg = ctx.cfg.resources.train_pool if ctx.cfg.rollout.colocate else (
        ctx.cfg.resources.rollout_pool)
    if pool_cfg is not None and per_engine > pool_cfg.gpus_per_node and (
            _one_node_engine_fits(ctx, pool_cfg.gpus_per_node)):
        yield warning(("rollout.gpus_per_engine", f"{pool}.gpus_per_node"), f"one engine spans "
                      f"{per_engine} GPUs but a node has {pool_cfg.gpus_per_node}: its tensor "
                      f"parallelism crosses the network", "keep rollout.gpus_per_engine <= "
                      f"{pool_cfg.gpus_per_node}")


def _one_node_engine_fits(ctx: Context, gpus_per_node: int) -> bool:
    """Whether an engine of one node's GPUs leaves room for KV cache (True when not known)."""
    if ctx.model is None or ctx.cfg.resources.gpu_memory_gb is None:
        return True
    rollout = ctx.cfg.rollout.model_copy(update={"gpus_per_engine": gpus_per_node})
    return bool(kv_cache_sequences(ctx.cfg.model_copy(update={"rollout": rollout}), ctx.model))


def check_engine_heads(ctx: Context) -> Iterator[Problem]:
    """An engine's tensor parallelism must split the attention and KV heads too."""
    model, tp = ctx.model, ctx.cfg.rollout.gpus_per_engine
    if model is None or tp == 1:
        return
    heads, kv = model.num_attention_heads, model.num_kv_heads
    if heads % tp or (kv % tp and tp % kv):
        gpus = rollout_pool_gpus(ctx.cfg) or tp
        options = [d for d in divisors(heads) if (kv % d == 0 or d % kv == 0) and gpus % d == 0]
        yield error("rollout.gpus_per_engine", f"the model's {heads} attention heads / {kv} KV "
                    f"heads do not split over an engine of {tp} GPUs",
                    f"use rollout.gpus_per_engine={_pick(options, tp)}")


def check_engine_memory(ctx: Context) -> Iterator[Problem]:
    """When GPU memory is known, an engine's weights must leave room for KV cache."""
    cfg, model = ctx.cfg, ctx.model
    if model is None or cfg.resources.gpu_memory_gb is None or kv_cache_sequences(cfg, model):
        return
    gpus = rollout_pool_gpus(cfg) or cfg.rollout.gpus_per_engine
    fits = [d for d in divisors(gpus) if kv_cache_sequences(
        cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"gpus_per_engine": d})}),
        model)]
    fix = (f"use rollout.gpus_per_engine={fits[0]}" if fits else
           "use more GPUs per engine or a smaller model")
    yield error(("rollout.gpus_per_engine", "rollout.gpu_memory_utilization"),
                f"the weights of one engine (~{model.param_count() / 1e9:.1f}B parameters over "
                f"{cfg.rollout.gpus_per_engine} GPUs) leave no room for KV cache in "
                f"{cfg.resources.gpu_memory_gb} GB x {cfg.rollout.gpu_memory_utilization}",
                f"{fix}, or raise rollout.gpu_memory_utilization")


def check_engine_concurrency(ctx: Context) -> Iterator[Problem]:
    """Warn when an engine receives more sequences per step than it runs (or can hold) at once."""
    s, rollout = ctx.sizes, ctx.cfg.rollout
    if s.sequences_per_engine is None:
        return
    wanted = math.ceil(s.sequences_per_engine)
    fit = s.kv_cache_sequences_per_engine
    if rollout.max_num_seqs != "auto" and rollout.max_num_seqs < wanted:
        target = wanted if fit is None else min(wanted, fit)
        yield warning("rollout.max_num_seqs", f"each engine receives {wanted} sequences per step "
                      f"but runs at most {rollout.max_num_seqs} at once; the rest queue",
                      f"set rollout.max_num_seqs={target} (or auto)")
    elif rollout.max_num_seqs != "auto" and fit and rollout.max_num_seqs > fit:
        yield warning("rollout.max_num_seqs", f"the KV cache of one engine holds about {fit} "
                      f"full-length sequences, fewer than max_num_seqs={rollout.max_num_seqs}; "
                      "the engine will evict and recompute", f"set rollout.max_num_seqs={fit} "
                      "(or auto)")
    if fit and fit < wanted:
        yield warning(("rollout.gpu_memory_utilization", "data.max_response_length"),
                      f"the KV cache of one engine holds about {fit} full-length sequences but "
                      f"{wanted} arrive per step; the rest queue", "use more or larger engines, "
                      "raise rollout.gpu_memory_utilization, or shorten data.max_response_length")


FP8_BLOCK = 128


def check_engine_fp8_blocks(ctx: Context) -> Iterator[Problem]:
    """SGLang in block FP8 needs every TP-split projection (q, k, v, the MLP's and the experts'
    intermediate size per GPU) to be whole 128x128 blocks (``Fp8LinearMethod``'s
    ``validate_block_quant_shapes``, ``Fp8MoEMethod.create_weights``; docs/fp8.md)."""
    cfg, model = ctx.cfg, ctx.model
    if (model is None or cfg.rollout.quantization != "fp8" or cfg.rollout.backend != "sglang"
            or model.kv_lora_rank):
        return
    def widths(tp: int) -> dict[str, int]:
        kv_heads = max(1, model.num_kv_heads // tp)
        out = {"q": model.num_attention_heads // tp * model.head_dim,
               "k/v": kv_heads * model.head_dim}
        if not model.is_moe or model.dense_layers:
            out["intermediate_size"] = model.ffn_hidden_size // tp
        if model.is_moe:
            out["moe_intermediate_size"] = model.moe_ffn_hidden_size // tp
        return out

    tp = cfg.rollout.gpus_per_engine
    ragged = {k: v for k, v in widths(tp).items() if v % FP8_BLOCK}
    if ragged:
        fits = [d for d in divisors(model.num_attention_heads)
                if not any(v % FP8_BLOCK for v in widths(d).values())]
        fix = (f"use rollout.gpus_per_engine={_pick(fits, tp)}, " if fits else "") + \
            "rollout.backend=local (the embedded engine has no such rule) or rollout.quantization=null"
        yield error(("rollout.quantization", "rollout.gpus_per_engine"),
                    "SGLang's block-FP8 layers need multiples of 128 per GPU; an engine of "
                    f"{tp} GPU(s) has " + ", ".join(f"{k} {v}" for k, v in ragged.items()),
                    fix)


LAYOUT_RULES: tuple[Rule, ...] = (
    check_layout_fills_train_pool, check_expert_layout, check_experts_divisible_by_ep,
    check_heads_divisible_by_tp, check_kv_heads_vs_tp, check_ffn_divisible,
    check_layers_divisible_by_pp, check_moe_tp_sequence_parallel, check_recompute_layers,
    check_recompute_modules,
    check_context_parallel_sequence_length, check_context_parallel_combinations,
    check_vocab_and_tokenizer,
    check_sequence_fits_positions, check_engines_fill_rollout_pool, check_engine_heads,
    check_engine_memory, check_engine_concurrency, check_engine_fp8_blocks,
)
