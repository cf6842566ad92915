"""The copy_digit task is learnable from scratch: a naive GRPO loop on a tiny random MoE model.

Slow (~20 s): run with ``pytest -m slow tests/data``. The loop is written here on purpose (HF
transformers sampling, group-normalised advantages, token-mean policy gradient), so the check is
about the task's design, not about megarl's trainer.
"""

from __future__ import annotations

import pytest
import torch

from megarl.data.dataset import load_prompt_dataset
from megarl.data.loader import PromptLoader
from megarl.data.synthetic import write_synthetic_dataset
from megarl.data.tiny_model import make_tiny_model
from megarl.reward.synthetic import score


def grpo_step(model, tokenizer, batch, optimizer, n: int = 8, max_new: int = 12) -> float:
    """Sample n responses per prompt, update with group-normalised advantages; mean reward."""
    prompts = torch.tensor([item["input_ids"] for item in batch])  # copy_digit: equal lengths
    inputs = prompts.repeat_interleave(n, 0)
    with torch.no_grad():
        out = model.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs),
                             do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=max_new, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    responses = out[:, inputs.shape[1]:]
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    rewards = torch.tensor([score(batch[i // n]["data_source"], text, batch[i // n]["ground_truth"])
                            for i, text in enumerate(texts)])
    groups = rewards.view(-1, n)
    adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6))
    eos = responses == tokenizer.eos_token_id
    mask = ((eos.cumsum(1) - eos.long()) == 0).float()  # up to and including the first eos
    logits = model(input_ids=out).logits[:, inputs.shape[1] - 1:-1]
    logp = torch.log_softmax(logits, -1).gather(-1, responses[..., None]).squeeze(-1)
    loss = -(adv.view(-1, 1) * logp * mask).sum() / mask.sum()
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return rewards.mean().item()


@pytest.mark.slow
def test_copy_digit_reward_rises_within_50_grpo_steps(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model_dir = make_tiny_model(tmp_path / "model", arch="qwen3_moe")
    path = write_synthetic_dataset(tmp_path / "copy.parquet", "copy_digit", 512, seed=0)
    loader = PromptLoader(load_prompt_dataset(path, model_dir, max_prompt_length=64), 16)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    torch.manual_seed(0)
    rewards = [grpo_step(model, tokenizer, loader.next_batch(), optimizer) for _ in range(50)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.15 and last > 0.4, (first, last, rewards)
