"""Experiment trackers: where the per-step metric dict of the trainer goes.

Every tracker takes the same call, ``log(metrics, step)`` once per step with all metrics of that
step in one dict, and ``close()`` at the end. ``MultiTracker.from_names`` builds the set named by
``trainer.loggers`` (``console``, ``jsonl``, ``tensorboard``, ``wandb``).

Resuming: pass ``TrackerSettings.resume_from_step`` (the step of the checkpoint resumed from).
The JSONL file then drops rows after that step (they belong to the discarded continuation and
will be produced again), TensorBoard purges events from the next step on, and W&B continues the
run whose id is stored in ``<output_dir>/wandb_run_id.txt``.

W&B proxy (PITFALLS M5): ``trainer.wandb_proxy`` is handed to ``wandb.Settings(http_proxy=...,
https_proxy=...)``, which the W&B SDK applies only to its own requests to the W&B server.
megarl never writes ``HTTP_PROXY``/``HTTPS_PROXY`` into ``os.environ``: those would be inherited
by every HTTP client and subprocess of the job (rollout engines, Ray, the engine clients).
Secrets never reach a tracker: the run config sent to W&B has credential-like keys masked and
credentials inside URLs (``http://user:pass@host``) removed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Self, TextIO, runtime_checkable

from megarl.config.render import redact_secrets

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
WANDB_RUN_ID_FILE = "wandb_run_id.txt"


@runtime_checkable
class Tracker(Protocol):
    """Receives the metrics of each step."""

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Record all metrics of one step."""

    def close(self) -> None:
        """Flush and release files, writers and runs."""


def to_float(name: str, value: Any) -> float:
    """A metric value (python/numpy/torch scalar) as a python float; TypeError naming the metric."""
    try:
        return float(value)
    except (TypeError, ValueError) as err:
        raise TypeError(f"metric {name!r} has a non-numeric value {value!r} "
                        f"({type(value).__name__}); log one number per metric name") from err


# ---------------------------------------------------------------------------------------------
# Console
# ---------------------------------------------------------------------------------------------

# (metric name, short label, format) of the metrics shown on the one-line step summary.
CONSOLE_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("critic/score/mean", "score", "{:.4g}"),
    ("response_length/mean", "resp_len", "{:.1f}"),
    ("actor/pg_loss", "pg_loss", "{:.4g}"),
    ("actor/kl_loss", "kl", "{:.3g}"),
    ("actor/entropy", "entropy", "{:.3g}"),
    ("actor/grad_norm", "grad_norm", "{:.3g}"),
    ("training/rollout_probs_diff_mean", "probs_diff", "{:.2g}"),
    ("timing/step", "step_time", "{:.2f}s"),
    ("timing/gen", "gen", "{:.2f}s"),
    ("timing/update_actor", "update", "{:.2f}s"),
    ("throughput/total_tokens_per_sec", "tok/s", "{:.0f}"),
    ("throughput/gen_tokens_per_sec_per_gpu", "gen_tok/s/gpu", "{:.0f}"),
    ("perf/mfu/actor", "mfu", "{:.1%}"),
)


def format_duration(seconds: float) -> str:
    """Seconds as ``1h02m``, ``5m07s`` or ``42s``."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def format_console_line(metrics: Mapping[str, float], step: int,
                        total_steps: int | None = None) -> str:
    """The one-line summary of a step: ``step 3/10 | score 0.5 | resp_len 120.0 | ...``."""
    parts = [f"step {step}/{total_steps}" if total_steps else f"step {step}"]
    for name, label, fmt in CONSOLE_FIELDS:
        if name in metrics:
            value = to_float(name, metrics[name])
            parts.append(f"{label} {fmt.format(value) if math.isfinite(value) else value}")
    alarms = metrics.get("health/num_alarms", 0.0)
    if alarms:
        parts.append(f"alarms {int(alarms)}")
    return " | ".join(parts)


def text_progress_bar(step: int, total_steps: int, width: int = 20) -> str:
    """A plain-text progress bar for logs that are not a terminal: ``[#####---------------] 25%``."""
    fraction = min(max(step / total_steps, 0.0), 1.0) if total_steps > 0 else 1.0
    filled = round(fraction * width)
    return f"[{'#' * filled}{'-' * (width - filled)}] {fraction:4.0%}"


class ConsoleTracker:
    """One compact line per step, and a progress bar over ``total_steps``.

    On a terminal the bar is a tqdm bar kept at the bottom while the step lines scroll above it;
    elsewhere (log files, Ray/Slurm output) each line starts with a text bar and ends with an ETA
    from the mean wall time per logged step.
    """

    def __init__(self, total_steps: int | None = None, stream: TextIO | None = None,
                 start_step: int = 0) -> None:
        self.total_steps = total_steps
        self.stream = stream if stream is not None else sys.stdout
        self._start_step = start_step
        self._start_time = time.monotonic()
        self._bar = None
        is_tty = getattr(self.stream, "isatty", lambda: False)()
        if total_steps and is_tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, file=self.stream,
                             dynamic_ncols=True, unit="step", leave=True)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Print the step line and advance the progress bar."""
        line = format_console_line(metrics, step, self.total_steps)
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
            self._bar.update(max(0, step - self._bar.n))
            return
        if self.total_steps:
            done = step - self._start_step
            elapsed = time.monotonic() - self._start_time
            eta = elapsed / done * (self.total_steps - step) if done > 0 else None
            line = f"{text_progress_bar(step, self.total_steps)} {line}"
            if eta is not None:
                line += f" | eta {format_duration(eta)}"
        print(line, file=self.stream, flush=True)

    def warn(self, line: str) -> None:
        """Print a warning line (e.g. from the health monitor) without breaking the bar."""
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        """Close the progress bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# ---------------------------------------------------------------------------------------------
# JSONL
# ---------------------------------------------------------------------------------------------

def read_metrics_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file; a torn last line (a crash mid-write) is ignored."""
    rows: list[dict[str, Any]] = []
    lines = Path(path).read_text().splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                logger.warning("%s: ignoring a torn last line (%d chars)", path, len(line))
                continue
            raise ValueError(f"{path}: line {number} is not valid JSON; the file is damaged, "
                             f"move it away to start a fresh metrics log") from None
    return rows


class JsonlTracker:
    """``<output_dir>/metrics.jsonl``: one JSON object per step, flushed line by line.

    Each object holds ``step`` and the metric names as keys; a non-finite value is written as
    ``null`` (strict JSON). On restart the existing file is kept and appended to: with
    ``resume_from_step`` the rows after that step are dropped first (those steps run again);
    a step already in the file is not written a second time.
    """

    def __init__(self, output_dir: str | os.PathLike, resume_from_step: int | None = None) -> None:
        self.path = Path(output_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._steps_in_file: set[int] = set()
        self._steps_this_run: set[int] = set()
        if self.path.exists():
            self._load_existing(resume_from_step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (open until close())

    def _load_existing(self, resume_from_step: int | None) -> None:
        raw = self.path.read_text()
        rows = read_metrics_jsonl(self.path)
        kept = [r for r in rows if resume_from_step is None or int(r["step"]) <= resume_from_step]
        if len(kept) != len(rows) or (raw and not raw.endswith("\n")):
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)
        self._steps_in_file = {int(r["step"]) for r in kept}

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Append the row of ``step`` (skipped when the file already holds that step)."""
        if step in self._steps_this_run:
            raise ValueError(f"JsonlTracker: step {step} was logged twice; merge all metrics of "
                             f"a step into one dict before calling log()")
        self._steps_this_run.add(step)
        if step in self._steps_in_file:
            logger.info("%s already holds step %d; not writing it again", self.path, step)
            return
        row: dict[str, Any] = {"step": int(step)}
        for name, value in metrics.items():
            number = to_float(name, value)
            row[name] = number if math.isfinite(number) else None
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        if not self._file.closed:
            self._file.close()


# ---------------------------------------------------------------------------------------------
# TensorBoard
# ---------------------------------------------------------------------------------------------

class TensorboardTracker:
    """Scalars in ``<output_dir>/tensorboard`` through torch's SummaryWriter."""

    def __init__(self, output_dir: str | os.PathLike, resume_from_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError("trainer.loggers includes 'tensorboard' but the tensorboard package "
                              "is not installed: pip install 'megarl[tensorboard]', or remove "
                              "'tensorboard' from trainer.loggers") from err
        self.log_dir = Path(output_dir) / "tensorboard"
        purge_step = None if resume_from_step is None else resume_from_step + 1
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Write one scalar per metric at ``step``."""
        for name, value in metrics.items():
            self._writer.add_scalar(name, to_float(name, value), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


# ---------------------------------------------------------------------------------------------
# Weights & Biases
# ---------------------------------------------------------------------------------------------

def wandb_proxy_settings(proxy: str | None) -> dict[str, str]:
    """The ``wandb.Settings`` fields that route W&B's own traffic (and only it) through ``proxy``."""
    return {"http_proxy": proxy, "https_proxy": proxy} if proxy else {}


class WandbTracker:
    """A W&B run; needs the optional ``wandb`` package (``pip install 'megarl[wandb]'``).

    The run id is kept in ``<output_dir>/wandb_run_id.txt`` so a resumed job continues the same
    run. ``proxy`` applies to W&B alone (see the module docstring).
    """

    def __init__(self, settings: TrackerSettings) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ImportError("trainer.loggers includes 'wandb' but the wandb package is not "
                              "installed: pip install 'megarl[wandb]', or remove 'wandb' from "
                              "trainer.loggers") from err
        output_dir = Path(settings.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        id_file = output_dir / WANDB_RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else None
        try:
            wandb_settings = wandb.Settings(**wandb_proxy_settings(settings.wandb_proxy))
        except (TypeError, ValueError) as err:  # old signature / pydantic validation
            # `from None`: wandb's validation error would repeat the proxy URL, credentials too.
            raise ValueError(f"trainer.wandb_proxy: wandb {getattr(wandb, '__version__', '?')} "
                             f"rejected the proxy settings ({type(err).__name__}); upgrade wandb "
                             f"(pip install -U 'megarl[wandb]')") from None
        self._run = wandb.init(project=settings.project_name, name=settings.experiment_name,
                               config=redact_secrets(dict(settings.run_config)),
                               dir=str(output_dir), id=run_id, resume="allow",
                               settings=wandb_settings)
        if run_id is None:
            id_file.write_text(str(self._run.id) + "\n")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Send the metrics of ``step`` to the run."""
        self._run.log({name: to_float(name, v) for name, v in metrics.items()}, step=step)

    def close(self) -> None:
        """Finish the run (uploads what is pending)."""
        self._run.finish()


# ---------------------------------------------------------------------------------------------
# Composition
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrackerSettings:
    """What the trackers need from the config (``trainer.*``)."""

    output_dir: Path
    """``trainer.output_dir``: metrics.jsonl, tensorboard/ and the W&B run id go here."""
    total_steps: int | None = None
    """``trainer.total_steps``: the length of the console progress bar."""
    project_name: str = "megarl"
    """W&B project."""
    experiment_name: str = "run"
    """W&B run name."""
    wandb_proxy: str | None = None
    """``trainer.wandb_proxy``: proxy for W&B traffic only."""
    run_config: Mapping[str, Any] = field(default_factory=dict)
    """The resolved config, sent to W&B with secrets masked."""
    resume_from_step: int | None = None
    """The checkpoint step a resumed job starts after; None for a fresh run."""
    console_stream: TextIO | None = None
    """Where the console tracker prints; stdout when None."""


TRACKER_NAMES = ("console", "jsonl", "tensorboard", "wandb")


def build_tracker(name: str, settings: TrackerSettings) -> Tracker:
    """The tracker called ``name`` (one of TRACKER_NAMES)."""
    if name == "console":
        return ConsoleTracker(settings.total_steps, settings.console_stream,
                              start_step=settings.resume_from_step or 0)
    if name == "jsonl":
        return JsonlTracker(settings.output_dir, settings.resume_from_step)
    if name == "tensorboard":
        return TensorboardTracker(settings.output_dir, settings.resume_from_step)
    if name == "wandb":
        return WandbTracker(settings)
    raise ValueError(f"trainer.loggers: unknown tracker {name!r}; valid names: "
                     f"{', '.join(TRACKER_NAMES)}")


class MultiTracker:
    """Several trackers behind the Tracker interface; also a context manager that closes them."""

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        self.trackers = list(trackers)

    @classmethod
    def from_names(cls, names: Iterable[str], settings: TrackerSettings) -> MultiTracker:
        """Build the trackers named in ``trainer.loggers`` (duplicates ignored, order kept)."""
        names = list(dict.fromkeys(names))
        unknown = [n for n in names if n not in TRACKER_NAMES]
        if unknown:
            raise ValueError(f"trainer.loggers: unknown tracker name(s) {unknown}; valid names: "
                             f"{', '.join(TRACKER_NAMES)}")
        built: list[Tracker] = []
        try:
            for name in names:
                built.append(build_tracker(name, settings))
        except BaseException:
            for tracker in built:
                tracker.close()
            raise
        return cls(built)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Log to every tracker."""
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def warn(self, line: str) -> None:
        """Print a warning line through the console tracker, or log it when there is none."""
        consoles = [t for t in self.trackers if isinstance(t, ConsoleTracker)]
        if consoles:
            consoles[0].warn(line)
        else:
            logger.warning("%s", line)

    def close(self) -> None:
        """Close every tracker in order, even when one fails; the failure is re-raised."""
        with contextlib.ExitStack() as stack:
            for tracker in reversed(self.trackers):  # callbacks run last-in first-out
                stack.callback(tracker.close)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
