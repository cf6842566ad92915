"""Trackers: JSONL rows and resume, console line, TensorBoard events, tracker names, W&B setup."""

import importlib.util
import io
import json
import math
import os
import sys
import types

import pytest

from megarl.metrics.trackers import (
    ConsoleTracker,
    JsonlTracker,
    MultiTracker,
    TensorboardTracker,
    TrackerSettings,
    WandbTracker,
    format_console_line,
    read_metrics_jsonl,
    redact_secrets,
)


def step_metrics(step: int, offset: float = 0.0) -> dict[str, float]:
    return {
        "critic/score/mean": 0.1 * step + offset,
        "response_length/mean": 100.0 + step,
        "actor/pg_loss": -0.01 * step,
        "actor/kl_loss": 0.001 * step,
        "actor/grad_norm": 0.5,
        "timing/step": 1.5,
        "throughput/total_tokens_per_sec": 2000.0,
    }


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------------- JSONL

def test_jsonl_one_object_per_step_flushed_per_line(tmp_path):
    tracker = JsonlTracker(tmp_path)
    tracker.log(step_metrics(1), step=1)
    tracker.log({**step_metrics(2), "actor/entropy": float("nan")}, step=2)
    rows = read_lines(tmp_path / "metrics.jsonl")  # read before close: flushed per line
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0] == {"step": 1, **step_metrics(1)}
    assert rows[1]["actor/entropy"] is None  # non-finite -> null (strict JSON)
    tracker.close()


def test_jsonl_resume_drops_rows_after_checkpoint_and_never_duplicates(tmp_path):
    first = JsonlTracker(tmp_path)
    for step in range(1, 6):
        first.log(step_metrics(step), step)
    first.close()
    # The job crashed after step 5; the last checkpoint is step 3: steps 4, 5 run again.
    resumed = JsonlTracker(tmp_path, resume_from_step=3)
    for step in range(4, 7):
        resumed.log(step_metrics(step, offset=100.0), step)
    resumed.close()
    rows = read_lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[2]["critic/score/mean"] == pytest.approx(0.3)
    assert rows[3]["critic/score/mean"] == pytest.approx(100.4)  # the new run's value


def test_jsonl_reopen_without_resume_step_skips_steps_already_present(tmp_path):
    first = JsonlTracker(tmp_path)
    for step in (1, 2):
        first.log(step_metrics(step), step)
    first.close()
    again = JsonlTracker(tmp_path)
    again.log(step_metrics(2, offset=50.0), 2)
    again.log(step_metrics(3), 3)
    again.close()
    rows = read_lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["critic/score/mean"] == pytest.approx(0.2)


def test_jsonl_repairs_torn_last_line_and_rejects_double_log(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "a": 1.0}) + "\n" + '{"step": 2, "a"')
    tracker = JsonlTracker(tmp_path)
    tracker.log({"a": 2.0}, 2)
    with pytest.raises(ValueError, match="step 2 was logged twice"):
        tracker.log({"b": 1.0}, 2)
    tracker.close()
    assert read_metrics_jsonl(path) == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}]


def test_non_numeric_metric_is_named(tmp_path):
    tracker = JsonlTracker(tmp_path)
    with pytest.raises(TypeError, match="'actor/lr'"):
        tracker.log({"actor/lr": "fast"}, 1)
    tracker.close()


# ----------------------------------------------------------------------------------- Console

def test_console_line_contents_and_text_progress_bar():
    out = io.StringIO()
    console = ConsoleTracker(total_steps=10, stream=out)
    for step in (1, 2, 3):
        console.log({**step_metrics(step), "health/num_alarms": float(step == 3)}, step)
    console.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    last = lines[-1]
    assert last.startswith("[######--------------]  30% step 3/10 | ")
    for piece in ("score 0.3", "resp_len 103.0", "pg_loss -0.03", "kl 0.003", "grad_norm 0.5",
                  "step_time 1.50s", "tok/s 2000", "alarms 1", "| eta "):
        assert piece in last, (piece, last)
    assert "alarms" not in lines[0]


def test_console_line_without_total_and_with_missing_metrics():
    line = format_console_line({"critic/score/mean": 0.25, "actor/entropy": math.inf}, 7)
    assert line == "step 7 | score 0.25 | entropy inf"


class FakeTerminal(io.StringIO):
    """A text stream that says it is a terminal, so the console tracker draws a tqdm bar."""

    def isatty(self) -> bool:
        return True


def test_console_uses_tqdm_bar_on_a_terminal():
    out = FakeTerminal()
    console = ConsoleTracker(total_steps=4, stream=out)
    console.log(step_metrics(1), 1)
    console.log(step_metrics(2), 2)
    console.warn("[health] step 2 kl_high: something")
    assert console._bar.n == 2
    console.close()
    text = out.getvalue()
    assert "2/4" in text and "step 2/4 | score 0.2" in text
    assert "[health] step 2 kl_high" in text


# ------------------------------------------------------------------------------- TensorBoard

def load_scalars(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_event_file_readable_back(tmp_path):
    tracker = TensorboardTracker(tmp_path)
    for step in range(1, 4):
        tracker.log(step_metrics(step), step)
    tracker.close()
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tensorboard").iterdir())
    scalars = load_scalars(tmp_path / "tensorboard", "critic/score/mean")
    assert [s for s, _ in scalars] == [1, 2, 3]
    assert [v for _, v in scalars] == pytest.approx([0.1, 0.2, 0.3], rel=1e-6)


def test_tensorboard_resume_purges_rerun_steps(tmp_path):
    first = TensorboardTracker(tmp_path)
    for step in range(1, 5):
        first.log({"x": float(step)}, step)
    first.close()
    resumed = TensorboardTracker(tmp_path, resume_from_step=2)
    for step in (3, 4):
        resumed.log({"x": 10.0 * step}, step)
    resumed.close()
    assert load_scalars(tmp_path / "tensorboard", "x") == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


# ------------------------------------------------------------------------------ MultiTracker

def test_multi_tracker_rejects_unknown_name_listing_valid_ones(tmp_path):
    settings = TrackerSettings(output_dir=tmp_path)
    with pytest.raises(ValueError) as info:
        MultiTracker.from_names(["console", "tensorbord"], settings)
    message = str(info.value)
    assert "trainer.loggers" in message and "'tensorbord'" in message
    assert "console, jsonl, tensorboard, wandb" in message


def test_multi_tracker_logs_to_every_tracker(tmp_path):
    out = io.StringIO()
    settings = TrackerSettings(output_dir=tmp_path, total_steps=2, console_stream=out)
    with MultiTracker.from_names(["console", "jsonl", "tensorboard", "jsonl"], settings) as multi:
        assert [type(t).__name__ for t in multi.trackers] == [
            "ConsoleTracker", "JsonlTracker", "TensorboardTracker"]
        multi.log(step_metrics(1), 1)
        multi.warn("[health] a warning")
    assert "step 1/2" in out.getvalue() and "[health] a warning" in out.getvalue()
    assert read_metrics_jsonl(tmp_path / "metrics.jsonl")[0]["step"] == 1
    assert load_scalars(tmp_path / "tensorboard", "actor/grad_norm") == [(1, 0.5)]


# ------------------------------------------------------------------------------------- W&B

@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_missing_gives_install_hint(tmp_path):
    with pytest.raises(ImportError, match=r"pip install 'megarl\[wandb\]'"):
        WandbTracker(TrackerSettings(output_dir=tmp_path))


def test_redact_secrets_masks_keys_and_url_credentials():
    config = {"trainer": {"wandb_proxy": "http://alice:s3cret@proxy:3128", "wandb_api_key": "abc",
                          "total_steps": 5},
              "model": {"tokenizer_path": "/m", "hf_token": "hf_x"},
              "rollout": {"max_tokens": 128, "urls": ["https://u:p@host/x"]}}
    red = redact_secrets(config)
    assert red["trainer"] == {"wandb_proxy": "http://***@proxy:3128", "wandb_api_key": "***",
                              "total_steps": 5}
    assert red["model"] == {"tokenizer_path": "/m", "hf_token": "***"}
    assert red["rollout"] == {"max_tokens": 128, "urls": ["https://***@host/x"]}
    assert "s3cret" not in json.dumps(red)


def test_wandb_proxy_goes_to_wandb_settings_not_environment(tmp_path, monkeypatch):
    # wandb is an optional package and cannot reach its server here; this stand-in records
    # what megarl hands to wandb.Settings / wandb.init (the real calls need the network).
    calls = {}

    class Run:
        id = "run123"

        def log(self, data, step):
            calls.setdefault("log", []).append((step, data))

        def finish(self):
            calls["finished"] = True

    def settings(**kwargs):
        calls["settings"] = kwargs
        return kwargs

    def init(**kwargs):
        calls["init"] = kwargs
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(Settings=settings, init=init))
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(var, raising=False)
    proxy = "http://bob:pw@proxy.local:3128"
    settings_obj = TrackerSettings(output_dir=tmp_path, wandb_proxy=proxy,
                                   run_config={"trainer": {"wandb_proxy": proxy}})
    tracker = WandbTracker(settings_obj)
    tracker.log({"critic/score/mean": 0.5}, 3)
    tracker.close()
    assert calls["settings"] == {"http_proxy": proxy, "https_proxy": proxy}
    assert calls["init"]["settings"] is not None and calls["init"]["resume"] == "allow"
    assert "pw@" not in json.dumps(calls["init"]["config"])
    assert not any(os.environ.get(v) for v in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy",
                                               "https_proxy"))
    assert calls["log"] == [(3, {"critic/score/mean": 0.5})] and calls["finished"]
    assert (tmp_path / "wandb_run_id.txt").read_text().strip() == "run123"
    WandbTracker(settings_obj).close()
    assert calls["init"]["id"] == "run123"  # a restarted job continues the same run


def test_multi_tracker_close_closes_all_even_when_one_fails(tmp_path):
    closed = []

    class Failing:
        def log(self, metrics, step):
            pass

        def close(self):
            closed.append("failing")
            raise OSError("disk full")

    jsonl = JsonlTracker(tmp_path)
    multi = MultiTracker([Failing(), jsonl])
    with pytest.raises(OSError, match="disk full"):
        multi.close()
    assert closed == ["failing"] and jsonl._file.closed
