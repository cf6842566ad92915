"""What ``megarl config show`` and ``megarl train`` print of the estimates
(:mod:`megarl.config.estimates`: the formulas), and the validation rule that warns when a phase
needs more than ``resources.gpu_memory_gb`` (PITFALLS T1)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from megarl.config.derived import DerivedSizes
from megarl.config.estimates import (
    BUCKETS_IN_FLIGHT,
    GB,
    EngineMemory,
    Estimates,
    UpdateMemory,
    estimate,
    size,
)
from megarl.config.model_info import ModelInfo
from megarl.config.problems import Context, Problem, warning
from megarl.config.schema import RunConfig


def billions(count: int) -> str:
    """A parameter count in billions with 3 significant digits (``30.5B``, ``0.596B``)."""
    text = f"{count / 1e9:.3g}"
    if "e" in text:  # tiny test models: plain decimals instead of an exponent
        text = f"{count / 1e9:.9f}".rstrip("0")
    return f"{text}B"


def count(n: int) -> str:
    """A parameter count with its unit: ``3.62B``, ``385M``, ``41.5K``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale * 0.9995:  # 999.6M shows as 1B, not 1e+03M
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _step_optimizer(u: UpdateMemory) -> str:
    """The optimizer state an optimizer step holds: all of it, or with streamed moments the
    rest and three chunks of them."""
    st = u.state
    if not u.stream_window or u.stream_window >= st.moments:
        return size(st.optimizer)
    return (f"{size(st.optimizer - st.moments)} + Adam moments {size(u.stream_window)} at a time "
            f"of {size(st.moments)} (actor.offload.optimizer_step_chunk_mb)")


def _update_rows(cfg: RunConfig, est: Estimates) -> list[tuple[str, str]]:
    """Rows of the actor's update and the weight sync."""
    u, st = est.update, est.update.state
    others = f" + idle ref/critic {size(u.other_roles)}" if u.other_roles else ""
    rc = cfg.actor.recompute
    recompute = rc.granularity + (f" ({rc.method}, {rc.num_layers} layer(s) per unit)"
                                  if rc.granularity == "full" else "")
    sync_engine = (f" + engine weights {size(est.engine.weights)}"
                   if est.engine is not None and est.engine.colocated else "")
    if u.optimizer_deferred:  # the optimizer state comes back for the steps only
        update = [
            ("actor update", (f"weights {size(st.weights)} + grads {size(st.grads)} + "
                              f"activations {size(u.activations)} + logits {size(u.logits)}"
                              f"{others} = {size(u.forward_backward)}")),
            ("", (f"optimizer step: weights + grads + optimizer {_step_optimizer(u)}{others} = "
                  f"{size(u.optimizer_step)} (actor.offload.optimizer_offload); peak "
                  f"{size(u.total)}"))]
    else:
        update = [
            ("actor update", (f"weights {size(st.weights)} + grads {size(st.grads)} + optimizer "
                              f"{size(st.optimizer)} + activations {size(u.activations)} + "
                              f"logits {size(u.logits)}{others} = {size(u.total)}"))]
    return [
        *update,
        ("", (f"pipeline stage {u.stage + 1} of {u.pp}: {count(st.dense_params)} non-expert + "
              f"{count(st.expert_params)} expert params per GPU; {u.tokens_per_micro_batch} "
              f"tokens per micro-batch x {u.micro_batches_in_flight:g} in flight; recompute "
              f"{recompute}")),
        ("log-prob forward", (f"actor {size(est.sync_actor)} + activations "
                              f"{size(est.log_prob.activations)} + log-probs "
                              f"{size(est.log_prob.log_probs)}{others} = "
                              f"{size(est.log_prob.total)}")),
        ("", f"{est.log_prob.tokens_per_micro_batch} tokens per forward (no backward)"),
        ("weight sync", (f"actor {size(est.sync_actor)}"
                         + (f" + idle ref/critic {size(u.other_roles)}" if u.other_roles else "")
                         + f" + {BUCKETS_IN_FLIGHT} buckets {size(est.buckets)}{sync_engine} = "
                         f"{size(est.sync)}")),
    ]


def _engine_rows(e: EngineMemory) -> list[tuple[str, str]]:
    """Rows of one rollout-engine GPU."""
    name = f"rollout GPU (engine of {e.gpus_per_engine})"
    per_seq = f"KV {size(e.kv_bytes_per_sequence)} per full-length sequence"
    if e.usable is None:
        return [(name, f"weights {size(e.weights)}; {per_seq}")]
    in_flight = "" if e.max_num_seqs is None else (
        f"; max_num_seqs {e.max_num_seqs} need {size(e.max_num_seqs * e.kv_bytes_per_sequence)}")
    rows = [(name, (f"weights {size(e.weights)} + KV cache {size(e.kv_pool or 0)} = "
                    f"{size(max(e.usable, e.weights))} (fits {e.sequences_fit} full-length "
                    f"sequences{in_flight})"))]
    if e.colocated:
        rows.append(("", (f"+ {size(e.train_resident)} the train roles keep on the GPU "
                          f"(colocated) = {size(e.total)}")))
    return rows


def format_estimates(cfg: RunConfig, model: ModelInfo | None, sizes: DerivedSizes,
                     extra_rows: Sequence[tuple[str, str]] = ()) -> list[str]:
    """The estimates as lines: the parameter counts, then one aligned row per phase (and the
    ``extra_rows``: the host memory of :func:`megarl.config.host_estimates.host_rows`)."""
    if model is None:
        return ["n/a: model.path has no readable config.json"]
    est = estimate(cfg, model, sizes)
    rows = _update_rows(cfg, est)
    if est.engine is not None:
        rows += _engine_rows(est.engine)
    rows.append(("GPU memory", size(est.gpu_memory) if est.gpu_memory is not None else
                 "unknown: set resources.gpu_memory_gb to check the phases against it"))
    rows += extra_rows
    width = max(len(name) for name, _ in rows)
    return [f"params/total: {billions(est.params.total)}",
            f"params/active: {billions(est.params.active)}",
            *(f"{name:<{width}}  {value}" for name, value in rows)]


def startup_estimates(cfg: RunConfig, model: ModelInfo | None, sizes: DerivedSizes,
                      extra_rows: Sequence[tuple[str, str]] = ()) -> list[str]:
    """The block ``megarl train`` prints at start: ``config show``'s estimate rows, titled (T1)."""
    known = cfg.resources.gpu_memory_gb is not None
    title = ("memory estimate per GPU (formulas in megarl/config/estimates.py)" if known else
             "memory estimate per GPU (estimate only: resources.gpu_memory_gb is unknown, so "
             "the phases are not checked against the GPUs)")
    return [title, *(f"  {line}" for line in format_estimates(cfg, model, sizes, extra_rows))]


# ---------------------------------------------------------------------------------------------
# Validation rule (PITFALLS T1)


def _update_fix(cfg: RunConfig, u: UpdateMemory) -> tuple[tuple[str, ...], str]:
    """The knobs (fields, advice) for the two largest parts of the update's memory."""
    micro = ("actor.ppo_max_token_len_per_gpu" if cfg.actor.use_dynamic_bsz
             else "actor.ppo_micro_batch_size_per_gpu")
    knobs = {
        "activations": ((micro, "actor.recompute.granularity", "actor.parallel.cp"),
                        (f"lower {micro}, set actor.recompute.granularity=full or raise "
                         "actor.parallel.cp")),
        "state": (("actor.parallel.tp", "actor.parallel.pp", "actor.parallel.ep"),
                  ("raise actor.parallel.tp / pp (ep for experts) or add GPUs to the train pool "
                   "(more data-parallel optimizer shards)")),
        "others": (("ref.offload.param_offload", "critic.offload"),
                   ("offload the idle reference / critic (ref.offload.param_offload=true, "
                    "critic.offload.*)")),
    }
    parts = {"activations": u.activations + u.logits, "state": u.state.total,
             "others": u.other_roles}
    if u.optimizer_deferred and u.optimizer_step >= u.forward_backward:
        parts["activations"] = 0  # the optimizer step is the peak: no activations then
    elif not u.optimizer_deferred:
        knobs["optimizer"] = (("actor.offload.optimizer_offload",), (
            "set actor.offload.optimizer_offload=true (the optimizer state then comes to the GPU "
            "for the optimizer steps only)"))
        parts["optimizer"] = u.state.optimizer
    if not cfg.actor.use_distributed_optimizer:
        knobs["state"] = (("actor.use_distributed_optimizer",),
                          "set actor.use_distributed_optimizer=true to shard the optimizer over DP")
    top = sorted((name for name in parts if parts[name]), key=lambda n: -parts[n])[:2]
    fields = tuple(f for name in top for f in knobs[name][0])
    return fields, "; or ".join(knobs[name][1] for name in top)


def _colocated_fix(cfg: RunConfig, est: Estimates) -> str:
    """Advice for a colocated rollout that does not fit next to the train roles' state."""
    st, off = est.update.state, cfg.actor.offload
    steps = [f"actor.offload.{name}_offload=true (frees {size(value)})"
             for name, value, on in (("optimizer", st.optimizer, off.optimizer_offload),
                                     ("grad", st.grads, off.grad_offload)) if not on and value]
    engine = est.engine
    # the engine takes this fraction of what is free when it loads: its weights and one
    # full-length sequence's KV cache need at least this much of it
    need = (engine.weights + engine.kv_bytes_per_sequence) / engine.free_at_load if (
        engine is not None and engine.free_at_load) else 1.0
    fraction = math.ceil(need * 20) / 20
    other = (f"raise rollout.gpu_memory_utilization to {fraction:.2f}" if fraction <= 0.95 else
             "use a separate rollout pool")
    return "set " + " and ".join(steps) + f", or {other}" if steps else other


def check_memory_fits(ctx: Context) -> Iterator[Problem]:
    """Warn when a phase needs more memory than one GPU has (T1), naming the knobs."""
    cfg, model = ctx.cfg, ctx.model
    if model is None or cfg.resources.gpu_memory_gb is None:
        return
    est, limit, mem = estimate(cfg, model, ctx.sizes), int(cfg.resources.gpu_memory_gb * GB), (
        cfg.resources.gpu_memory_gb)
    u = est.update
    if u.total > limit:
        fields, fix = _update_fix(cfg, u)
        deferred = (f"; the optimizer state is on the GPU for the steps only: forwards and "
                    f"backwards {size(u.forward_backward)}, a step {size(u.optimizer_step)}"
                    if u.optimizer_deferred else "")
        yield warning(("resources.gpu_memory_gb", *fields), (
            f"an actor GPU (pipeline stage {u.stage + 1} of {u.pp}) needs ~{size(u.total)} in "
            f"the update (weights {size(u.state.weights)}, grads {size(u.state.grads)}, "
            f"optimizer {size(u.state.optimizer)}, activations {size(u.activations)}, logits "
            f"{size(u.logits)}{deferred}) but a GPU has {mem} GB"), fix)
    lp = est.log_prob
    if lp.total > limit and lp.total > u.total:  # else the update's warning says it first
        budget = ("actor.log_prob_max_token_len_per_gpu" if cfg.actor.use_dynamic_bsz
                  else "actor.log_prob_micro_batch_size_per_gpu")
        yield warning(("resources.gpu_memory_gb", budget), (
            f"an actor GPU needs ~{size(lp.total)} in a log-prob forward of "
            f"{lp.tokens_per_micro_batch} tokens (actor {size(lp.resident)}, activations "
            f"{size(lp.activations)}, log-probs {size(lp.log_probs)}) but a GPU has {mem} GB"),
            f"lower {budget} (and ref.{budget.split('.', 1)[1]})")
    if est.sync > limit:
        yield warning(("resources.gpu_memory_gb", "checkpoint_engine.bucket_size_mb",
                       "actor.offload"), (
            f"the weight sync needs ~{size(est.sync)} on an actor GPU (incl. "
            f"{BUCKETS_IN_FLIGHT} bucket buffers, {size(est.buckets)}) but a GPU has {mem} GB"),
            "lower checkpoint_engine.bucket_size_mb or set actor.offload.optimizer_offload=true")
    engine = est.engine
    if engine is not None and engine.colocated and not engine.sequences_fit:
        # SGLang's sizing: the engine takes gpu_memory_utilization of what is free as it loads
        yield warning(("resources.gpu_memory_gb", "rollout.gpu_memory_utilization",
                       "actor.offload"), (
            f"a colocated engine gets {size(engine.usable or 0)} (gpu_memory_utilization "
            f"{cfg.rollout.gpu_memory_utilization} of the {size(engine.free_at_load or 0)}"
            f" free next to the {size(engine.train_resident)} the train roles keep on a "
            f"{mem} GB GPU); its weights take {size(engine.weights)}, which leaves no KV cache "
            "for one full-length sequence"), _colocated_fix(cfg, est))
