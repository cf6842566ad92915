"""Validation rules of the batch sizes (PITFALLS B2): train, mini- and micro-batches that
divide each other and split over the data-parallel ranks, for the actor and the critic."""

from __future__ import annotations

import math
from collections.abc import Iterator

from megarl.config.derived import divisors, is_whole, nearest_divisor, nearest_multiple
from megarl.config.problems import Context, Problem, error


def check_mini_batch_divides_train_batch(ctx: Context) -> Iterator[Problem]:
    """train_batch_size >= ppo_mini_batch_size, and a whole number of mini-batches per step."""
    train, mini = ctx.cfg.data.train_batch_size, ctx.cfg.actor.ppo_mini_batch_size
    fields = ("data.train_batch_size", "actor.ppo_mini_batch_size")
    if mini > train:
        yield error(fields, f"ppo_mini_batch_size {mini} is larger than train_batch_size {train}",
                    f"set actor.ppo_mini_batch_size={nearest_divisor(train, mini)} or "
                    f"data.train_batch_size={mini}")
    elif train % mini:
        yield error(fields, f"train_batch_size {train} is not a multiple of ppo_mini_batch_size "
                    f"{mini}", f"set actor.ppo_mini_batch_size={nearest_divisor(train, mini)} or "
                    f"data.train_batch_size={nearest_multiple(mini, train)}")


def check_micro_batch_sizes_exclusive(ctx: Context) -> Iterator[Problem]:
    """Exactly one of the global and per-GPU micro-batch sizes (unless dynamic batch size)."""
    actor, dp = ctx.cfg.actor, ctx.sizes.actor.dp
    if actor.ppo_micro_batch_size is not None and actor.ppo_micro_batch_size_per_gpu is not None:
        yield error(("actor.ppo_micro_batch_size", "actor.ppo_micro_batch_size_per_gpu"),
                    "both the global and the per-GPU micro-batch size are set",
                    f"remove actor.ppo_micro_batch_size and keep "
                    f"actor.ppo_micro_batch_size_per_gpu={actor.ppo_micro_batch_size_per_gpu}")
    elif (actor.ppo_micro_batch_size is None and actor.ppo_micro_batch_size_per_gpu is None
          and not actor.use_dynamic_bsz):
        per_rank = ctx.sizes.sequences_per_mini_batch_per_dp_rank
        size = nearest_divisor(per_rank, 4) if is_whole(per_rank) else 1
        yield error("actor.ppo_micro_batch_size_per_gpu", "no micro-batch size is set",
                    f"set actor.ppo_micro_batch_size_per_gpu={size} (a divisor of the "
                    f"{per_rank if is_whole(per_rank) else 'n/a'} sequences a DP rank gets per "
                    f"mini-batch, dp={dp}) or actor.use_dynamic_bsz=true")


def check_global_micro_batch_splits_over_dp(ctx: Context) -> Iterator[Problem]:
    """The deprecated global micro-batch must split evenly over the DP ranks."""
    actor, dp = ctx.cfg.actor, ctx.sizes.actor.dp
    micro = actor.ppo_micro_batch_size
    if (micro is None or actor.ppo_micro_batch_size_per_gpu is not None or actor.use_dynamic_bsz
            or not is_whole(dp) or micro % dp == 0):
        return
    yield error("actor.ppo_micro_batch_size", f"the global micro-batch of {micro} sequences does "
                f"not split over dp={dp} ranks", f"set actor.ppo_micro_batch_size="
                f"{nearest_multiple(dp, micro)} or use actor.ppo_micro_batch_size_per_gpu")


def _mini_options(train: int, n: int, dp: int) -> list[int]:
    """Mini-batch sizes (prompts) that divide train and give whole sequences per DP rank."""
    return [m for m in divisors(train) if (m * n) % dp == 0]


def check_mini_batch_splits_over_dp(ctx: Context) -> Iterator[Problem]:
    """(ppo_mini_batch_size x n) sequences must split evenly over the actor's DP ranks."""
    cfg, dp = ctx.cfg, ctx.sizes.actor.dp
    mini, n = cfg.actor.ppo_mini_batch_size, cfg.rollout.n
    if not is_whole(dp) or (mini * n) % dp == 0:
        return
    options = _mini_options(cfg.data.train_batch_size, n, dp)
    train = cfg.data.train_batch_size
    fix = (f"set actor.ppo_mini_batch_size={min(options, key=lambda m: (abs(m - mini), m))}"
           if options else f"set data.train_batch_size={nearest_multiple(dp, train)} and "
           f"actor.ppo_mini_batch_size={nearest_multiple(dp, mini)}")
    yield error(("actor.ppo_mini_batch_size", "rollout.n"), f"a mini-batch of {mini} prompts x "
                f"{n} samples = {mini * n} sequences does not split over dp={dp} ranks", fix)


def check_micro_batch_divides_mini_batch(ctx: Context) -> Iterator[Problem]:
    """The sequences a DP rank gets per mini-batch must be a multiple of its micro-batch."""
    s = ctx.sizes
    per_rank, micro = s.sequences_per_mini_batch_per_dp_rank, s.micro_batch_size_per_gpu
    if not is_whole(per_rank) or not is_whole(micro) or per_rank % micro == 0:
        return
    actor = ctx.cfg.actor
    field = ("actor.ppo_micro_batch_size_per_gpu" if actor.ppo_micro_batch_size_per_gpu
             else "actor.ppo_micro_batch_size")
    yield error((field, "actor.ppo_mini_batch_size", "rollout.n"),
                f"each DP rank gets {per_rank} sequences per mini-batch (ppo_mini_batch_size "
                f"{actor.ppo_mini_batch_size} x n {ctx.cfg.rollout.n} / dp {s.actor.dp}), not a "
                f"multiple of the micro-batch of {micro}",
                f"set actor.ppo_micro_batch_size_per_gpu={nearest_divisor(per_rank, micro)}")


def check_dynamic_bsz_token_budget(ctx: Context) -> Iterator[Problem]:
    """A dynamic micro-batch must hold at least one sequence of the longest length (each budget
    once: one that equals the budget it follows, as a derived one does, is that one's error)."""
    actor, data = ctx.cfg.actor, ctx.cfg.data
    cp = actor.parallel.cp
    longest = data.max_prompt_length + data.max_response_length
    if not actor.use_dynamic_bsz:
        return
    followed = None  # each budget follows the one before it
    for field, budget in (("actor.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu),
                          ("actor.log_prob_max_token_len_per_gpu",
                           actor.log_prob_max_token_len_per_gpu),
                          ("ref.log_prob_max_token_len_per_gpu",
                           ctx.cfg.ref.log_prob_max_token_len_per_gpu)):
        reported = budget == followed
        followed = budget
        if not reported and budget * cp < longest:
            yield error((field, "data.max_prompt_length", "data.max_response_length"),
                        f"the token budget {budget} x cp {cp} is smaller than one sequence of "
                        f"{data.max_prompt_length} + {data.max_response_length} = {longest} "
                        "tokens", f"set {field}={math.ceil(longest / cp)} or more")


def check_critic_batch_split(ctx: Context) -> Iterator[Problem]:
    """The critic's mini/micro batches must split like the actor's."""
    cfg = ctx.cfg
    critic = cfg.critic
    if not critic.enabled or critic.ppo_mini_batch_size is None:
        return
    train, mini, n = cfg.data.train_batch_size, critic.ppo_mini_batch_size, cfg.rollout.n
    if train % mini:
        yield error(("critic.ppo_mini_batch_size", "data.train_batch_size"), f"train_batch_size "
                    f"{train} is not a multiple of the critic's mini-batch {mini}",
                    f"set critic.ppo_mini_batch_size={nearest_divisor(train, mini)}")
        return
    dp = ctx.sizes.critic.dp if ctx.sizes.critic else ctx.sizes.actor.dp
    micro = critic.ppo_micro_batch_size_per_gpu
    if not is_whole(dp) or micro is None or cfg.actor.use_dynamic_bsz:
        return
    per_rank = mini * n / dp
    if per_rank != int(per_rank) or int(per_rank) % micro:
        fix = (f"set critic.ppo_micro_batch_size_per_gpu={nearest_divisor(int(per_rank), micro)}"
               if per_rank == int(per_rank) else "choose a critic.ppo_mini_batch_size whose "
               f"sequences split over dp={dp}")
        yield error(("critic.ppo_mini_batch_size", "critic.ppo_micro_batch_size_per_gpu"),
                    f"the critic's {mini * n} sequences per mini-batch over dp={dp} do not split "
                    f"into micro-batches of {micro}", fix)
