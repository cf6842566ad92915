"""TRL's side of ``benchmarks/e2e_step.py``: its ``GRPOTrainer`` at its one-GPU defaults with HF
generation, on the same model, prompts and forced response lengths as megarl's side, in a
process of its own (``python benchmarks/e2e_trl.py SPEC.json``, started by :func:`run_trl`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def kv_bytes_per_row(model: Path, tokens: int) -> int:
    """The bf16 KV cache HF ``generate`` holds for one row of ``tokens`` tokens."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2 * tokens


def generation_batches(samples: int, micro: int, n: int) -> list[int]:
    """The rows of one HF ``generate`` call that TRL accepts (``generation_batch_size``): those
    that divide the step's ``samples`` and are multiples of the micro-batch and the group."""
    step = math.lcm(micro, n)
    return [g for g in range(step, samples + 1, step) if samples % g == 0]


def generation_batch(samples: int, micro: int, n: int, row_bytes: int,
                     budget_bytes: float | None) -> int:
    """The largest of :func:`generation_batches` whose KV cache fits ``budget_bytes`` (None: no
    limit, e.g. on the CPU). TRL's default, every sample of the step in one call, would hold 512
    rows x 2,561 tokens of KV cache: 150 GB for the dense shape."""
    allowed = generation_batches(samples, micro, n)
    if not allowed:
        raise ValueError(f"TRL: {samples} samples per step cannot be split into generation "
                         f"batches of multiples of the micro-batch {micro} and the group {n}")
    if budget_bytes is None:
        return allowed[-1]
    fits = [g for g in allowed if g * row_bytes <= budget_bytes]
    return fits[-1] if fits else allowed[0]


def run_trl(args: argparse.Namespace, shape: str, model: Path, rows_path: Path) -> dict[str, Any]:
    """Runs :func:`trl_worker` in a child process (``python e2e_trl.py SPEC``) on the first
    ``--trl-prompts`` prompts; its per-step seconds, or why it did not run."""
    try:
        import trl  # noqa: F401
    except ImportError:
        return {"skipped": "trl is not installed (pip install 'megarl[bench]')"}
    out = args.out / shape / "trl"
    out.mkdir(parents=True, exist_ok=True)
    rows = rows_path.read_text().splitlines()
    prompts = args.trl_prompts or len(rows)
    if not 0 < prompts <= len(rows):
        return {"failed": f"--trl-prompts {args.trl_prompts}: between 1 and --prompts "
                          f"({len(rows)})"}
    trl_rows = out / "prompts.jsonl"
    trl_rows.write_text("\n".join(rows[:prompts]) + "\n")
    samples, micro = prompts * args.n, args.trl_micro_batch
    allowed = generation_batches(samples, micro, args.n)
    if not allowed or args.trl_generation_batch not in (0, *allowed):
        return {"failed": f"TRL's step of {samples} samples ({prompts} prompts x {args.n}) "
                          f"takes generation batches {allowed} with --trl-micro-batch {micro}; "
                          f"got --trl-generation-batch {args.trl_generation_batch}"}
    budget = None
    if args.device == "cuda":  # what is left for the KV cache next to the weights, their
        # gradients and two Adam moments (bf16, as TRL keeps them) and ~6 GB of activations
        total = torch.cuda.get_device_properties(0).total_memory
        weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        budget = 0.85 * total - 4 * weights - 6e9
    longest = args.prompt_len[1] + args.max_response + 1
    gen_batch = args.trl_generation_batch or generation_batch(
        samples, micro, args.n, kv_bytes_per_row(model, longest), budget)
    steps = args.trl_warmup + args.trl_steps
    spec = {"model": str(model), "prompts": str(trl_rows), "n": args.n, "median": args.median,
            "sigma": args.sigma, "max_response": args.max_response, "out": str(out),
            "steps": steps, "micro_batch": micro, "generation_batch": gen_batch,
            "result": str(out / "result.json"), "vllm": args.trl_vllm}
    (out / "spec.json").write_text(json.dumps(spec))
    print(f"[trl {shape}] {prompts} prompts x {args.n}, micro-batch {micro}, generate in "
          f"batches of {gen_batch}, {steps} steps ({args.trl_warmup} warm-up)", flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    log = out / "trl.log"
    with log.open("w") as stderr:
        proc = subprocess.run([sys.executable, __file__, str(out / "spec.json")],
                              env=env, cwd=REPO, check=False, stderr=stderr)
    if proc.returncode != 0:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line or "error:" in line]
        why = (errors or lines or ["no output"])[-1].strip()[:400]
        return {"failed": f"TRL exited with {proc.returncode}: {why} (log: {log})"}
    result = json.loads((out / "result.json").read_text())
    return {"walls": result["step_s"][args.trl_warmup:],
            "mean_completion_length": result["mean_completion_length"],
            "prompts": prompts, "micro_batch": micro, "generation_batch": gen_batch}


def trl_worker(spec_path: Path) -> int:
    """TRL's GRPOTrainer on the same model, prompts and forced lengths (the spec that
    :func:`run_trl` wrote); writes its step seconds."""
    from datasets import Dataset
    from transformers import AutoTokenizer, LogitsProcessor, LogitsProcessorList, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.e2e_step import response_length, score

    spec = json.loads(spec_path.read_text())
    model_dir = Path(spec["model"])
    rows = [json.loads(line) for line in Path(spec["prompts"]).read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(model_dir)
    eos = tok.eos_token_id
    n, median, sigma, cap = spec["n"], spec["median"], spec["sigma"], spec["max_response"]

    class ForceLengths(LogitsProcessor):
        """EOS is forbidden before the sample's forced length and forced right after it (the
        EOS is TRL's completion's last token, so the length is the forced one plus one)."""

        def __init__(self) -> None:
            self.targets: torch.Tensor | None = None
            self.start = 0

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if self.targets is None:
                self.start = input_ids.shape[1]
                seen: dict[tuple[int, ...], int] = {}
                targets = []
                for row in input_ids.tolist():
                    prompt = tuple(t for t in row if t != tok.pad_token_id)
                    j = seen.get(prompt, 0)
                    seen[prompt] = j + 1
                    targets.append(response_length(list(prompt), j, median, sigma, cap))
                self.targets = torch.tensor(targets, device=scores.device)
            done = input_ids.shape[1] - self.start
            force = self.targets == done
            scores[~force, eos] = -math.inf
            scores[force] = -math.inf
            scores[force, eos] = 0.0
            return scores

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.lengths: list[float] = []
            self.start = 0.0

        def on_log(self, *a: Any, logs: dict[str, Any] | None = None, **k: Any) -> None:
            if logs and "completions/mean_length" in logs:
                self.lengths.append(float(logs["completions/mean_length"]))

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.start)
            print(f"[trl] step {len(self.times)}: {self.times[-1]:.2f} s", flush=True)

    def reward(completions: list[str], **kwargs: Any) -> list[float]:
        return [score("e2e_bench", c, "") for c in completions]

    samples, micro = len(rows) * n, spec["micro_batch"]
    cuda = torch.cuda.is_available()
    config = GRPOConfig(
        output_dir=spec["out"], max_steps=spec["steps"], num_generations=n,
        per_device_train_batch_size=micro, gradient_accumulation_steps=samples // micro,
        generation_batch_size=spec["generation_batch"],
        max_completion_length=cap + 1, learning_rate=1e-6, beta=0.0, num_iterations=1,
        temperature=1.0, logging_steps=1, report_to=[], save_strategy="no", bf16=cuda,
        use_cpu=not cuda, model_init_kwargs={"dtype": torch.bfloat16 if cuda else torch.float32},
        dataloader_num_workers=0, seed=0, shuffle_dataset=False, disable_dropout=True,
        **({"use_vllm": True, "vllm_mode": "colocate"} if spec.get("vllm") else {}))
    dataset = Dataset.from_list([{"prompt": r["text"]} for r in rows] * spec["steps"])
    timer = StepTimes()
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=config,
                          train_dataset=dataset, processing_class=tok, callbacks=[timer])
    processor = ForceLengths()
    generate = trainer.model.generate

    def forced_generate(*a: Any, **k: Any) -> Any:
        processor.targets = None
        k["logits_processor"] = LogitsProcessorList([processor])
        return generate(*a, **k)

    trainer.model.generate = forced_generate
    trainer.train()
    Path(spec["result"]).write_text(json.dumps({"step_s": timer.times,
                                                "mean_completion_length": timer.lengths}))
    return 0


if __name__ == "__main__":
    sys.exit(trl_worker(Path(sys.argv[1])))
