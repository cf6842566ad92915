"""What validation reports: :class:`Problem` (one line each) and the :class:`Context` rules read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megarl.config.derived import DerivedSizes
from megarl.config.model_info import ModelInfo
from megarl.config.schema import ParallelConfig, RunConfig

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Problem:
    """One finding of validation: the fields involved, what is wrong, and how to fix it."""

    fields: tuple[str, ...]
    message: str
    fix: str
    severity: Severity = "error"
    rule: str = ""

    @property
    def is_error(self) -> bool:
        """Whether the run must not start with this problem."""
        return self.severity == "error"

    def line(self) -> str:
        """``field(s): what is wrong — fix``."""
        return f"{', '.join(self.fields)}: {self.message} — {self.fix}"


def error(fields: str | tuple[str, ...], message: str, fix: str) -> Problem:
    """An error naming ``fields``."""
    return Problem((fields,) if isinstance(fields, str) else fields, message, fix, "error")


def warning(fields: str | tuple[str, ...], message: str, fix: str) -> Problem:
    """A warning naming ``fields``."""
    return Problem((fields,) if isinstance(fields, str) else fields, message, fix, "warning")


@dataclass
class Context:
    """Everything a validation rule may look at."""

    cfg: RunConfig
    sizes: DerivedSizes
    model: ModelInfo | None = None
    model_error: str | None = None
    sources: dict[str, str] = field(default_factory=dict)
    allow_missing_files: bool = False

    def roles(self) -> list[tuple[str, ParallelConfig]]:
        """Train-side roles to check: the actor, plus ref/critic when on with their own layout."""
        out = [("actor", self.cfg.actor.parallel)]
        for role, section in (("ref", self.cfg.ref), ("critic", self.cfg.critic)):
            if section.enabled and section.parallel is not None and (
                    section.parallel != self.cfg.actor.parallel):
                out.append((role, section.parallel))
        return out

    def missing(self, fields: str | tuple[str, ...], message: str, fix: str) -> Problem:
        """A missing-file finding: an error, or a warning with ``allow_missing_files``."""
        make = warning if self.allow_missing_files else error
        return make(fields, message, fix)
