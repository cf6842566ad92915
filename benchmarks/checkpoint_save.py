"""Step time with a checkpoint after every step: blocking save vs background save
(``trainer.async_save``), measured in the same run on the tiny CPU model.

Two gloo ranks build the demo's tiny Qwen3-MoE (``megarl demo``'s model: expert parallel 2,
distributed Adam, fp32; ``--hidden`` makes it larger) and run steps shaped like the trainer's:
the actor ranks wait ``--gen-s`` seconds (the engines generate elsewhere), then train one
update, then save model + optimizer + RNG:

- ``blocking``: :func:`megarl.megatron.checkpoint.save_checkpoint` (plan, write, publish);
- ``background``: :class:`~megarl.megatron.checkpoint.BackgroundSaves` (plan and stage, a
  forked process per rank writes), the previous save published after the generation wait,
  where the trainer publishes it (the start of the next step's training).

Printed per mode: the median step time (generation wait + update + the time the step was
blocked by saving), the median blocked time, and the ratio background / blocking of both,
from alternating rounds of both modes. The first step of each round is left out of the medians
(the first save starts megatron's writer helper).

    python benchmarks/checkpoint_save.py [--steps 4] [--gen-s 1.0] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _train_step(actor, seed: int) -> None:
    """One PPO update on random sequences (the same on every rank)."""
    from megarl.megatron.logprobs import compute_log_probs
    from megarl.megatron.update import LossSettings, TrainSequence, train_step

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 128, (n,), generator=g) for n in (24, 31, 17, 28)]
    old = compute_log_probs(actor.model, seqs, max_tokens_per_micro_batch=64).log_probs
    batch = [TrainSequence(tokens=s, loss_mask=(torch.arange(len(s)) >= 2).float(), old_log_probs=lp,
                           advantages=torch.randn(len(s), generator=g))
             for s, lp in zip(seqs, old)]
    train_step(actor, batch, LossSettings(), max_tokens_per_micro_batch=64)


def _rank(rank: int, port: int, model_dir: str, root: str, steps: int, gen_s: float,
          reuse_plans: bool, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2)
    from megarl.megatron.checkpoint import (
        BackgroundSaves,
        SaveCache,
        save_checkpoint,
        start_save,
    )
    from megarl.megatron.model import build_actor_model
    from megarl.megatron.optimizer import OptimizerSettings, TrainableActor
    from megarl.megatron.parallel import ParallelSizes

    model = build_actor_model(model_dir, ParallelSizes(ep=2), torch.float32, spec="native")
    actor = TrainableActor(model, OptimizerSettings(lr=1e-4, total_steps=100))
    results = {}
    for mode in ("blocking", "background", "blocking", "background"):
        saves, cache = BackgroundSaves(), SaveCache() if reuse_plans else None
        step_s, blocked_s = [], []
        for step in range(1, steps + 1):
            dist.barrier()
            start = time.perf_counter()
            time.sleep(gen_s)  # the engines generate; the actor ranks wait
            waited = time.perf_counter()
            saves.finish()  # the trainer publishes the previous save before training
            blocked = time.perf_counter() - waited
            _train_step(actor, step)
            saving = time.perf_counter()
            if mode == "blocking":
                save_checkpoint(f"{root}/{mode}", actor, step, keep_last=2, cache=cache)
            else:
                saves.submit(start_save(f"{root}/{mode}", actor, step, keep_last=2,
                                        cache=cache))
            blocked += time.perf_counter() - saving
            step_s.append(time.perf_counter() - start)
            blocked_s.append(blocked)
        saves.finish()
        results.setdefault(mode, ([], []))
        results[mode][0].extend(step_s[1:])
        results[mode][1].extend(blocked_s[1:])
    if rank == 0:
        out.update(results)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per mode and round")
    parser.add_argument("--gen-s", type=float, default=1.0,
                        help="seconds the actor ranks wait for generation each step")
    parser.add_argument("--no-cache", action="store_true",
                        help="plan and validate every save from scratch (no SaveCache)")
    parser.add_argument("--hidden", type=int, default=None,
                        help="hidden size of the tiny MoE (default: the demo's)")
    args = parser.parse_args()
    from megarl.data.tiny_model import make_tiny_model
    from tests.megatron.dist_utils import free_port

    with tempfile.TemporaryDirectory() as tmp:
        extra = {} if args.hidden is None else {"hidden_size": args.hidden}
        model_dir = str(make_tiny_model(Path(tmp) / "model", arch="qwen3_moe", seed=0, **extra))
        size_mb = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors")) / 2**20
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(_rank, args=(free_port(), model_dir, f"{tmp}/ckpt", args.steps, args.gen_s,
                           not args.no_cache, out),
                     nprocs=2, join=True)
            results = dict(out)
    print(f"tiny MoE ({size_mb:.1f} MB of weights; Adam state 2x that), 2 gloo ranks EP=2, "
          f"generation wait {args.gen_s} s, {2 * (args.steps - 1)} timed steps per mode, "
          f"{'no ' if args.no_cache else ''}SaveCache")
    medians = {}
    for mode, (step_s, blocked_s) in results.items():
        medians[mode] = (statistics.median(step_s), statistics.median(blocked_s))
        print(f"{mode:>10}: step {medians[mode][0]:.3f} s (median), blocked by saving "
              f"{medians[mode][1]:.3f} s")
    (b_step, b_blocked), (a_step, a_blocked) = medians["blocking"], medians["background"]
    print(f"background / blocking: step time {a_step / b_step:.2f}x, "
          f"blocked time {a_blocked / b_blocked:.2f}x")


if __name__ == "__main__":
    main()
