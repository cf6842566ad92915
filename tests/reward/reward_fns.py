"""Reward functions for the reward-manager tests, loaded by module path and by file path."""

import os
import signal
import time


def exact_match(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 when the response equals the ground truth; a dict with extras for 'extras' sources."""
    score = float(solution_str.strip() == str(ground_truth).strip())
    if data_source == "extras":
        return {"score": score, "length": len(solution_str), "tag": extra_info.get("tag")}
    return score


def misbehaving(data_source, solution_str, ground_truth, extra_info=None):
    """Misbehaves as the data_source says; scores by exact match otherwise."""
    if data_source == "sleep":
        time.sleep(60)
    elif data_source == "hang":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        time.sleep(60)
    elif data_source == "raise":
        raise ZeroDivisionError("my reward divided by zero")
    elif data_source == "nan":
        return float("nan")
    elif data_source == "text":
        return "1.0"
    elif data_source == "no_score":
        return {"acc": 1.0}
    elif data_source == "exit":
        os._exit(3)
    elif data_source == "slow":
        time.sleep(0.3)
    return exact_match(data_source, solution_str, ground_truth, extra_info)


def batch_exact_match(data_sources, solution_strs, ground_truths, extra_infos):
    """Batched exact match; drops its last value when any data_source is 'drop_one'."""
    scores = [float(s.strip() == str(g).strip()) for s, g in zip(solution_strs, ground_truths)]
    if "drop_one" in data_sources:
        return scores[:-1]
    return scores


def wrong_arguments(response, answer):
    """A reward function whose parameters do not follow verl's names."""
    return 0.0


NOT_CALLABLE = 3
