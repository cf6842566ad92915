"""The resolved config as YAML, each value marked with where it came from (PITFALLS S6).

The output is valid YAML (marks, derived sizes and problems are comments), so it can be saved
next to a run's outputs and loaded again as a config. Secrets never reach it: a field whose name
says it holds a credential (``rollout.api_key``, ``*_token``, ``*password``, ...) is written as
``null`` with a comment saying to give it again, and ``user:password@`` is cut out of URLs
(:func:`redact_secrets` does the same for trackers that store the config).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import yaml

from megarl.config.derived import DerivedSizes, format_sizes
from megarl.config.problems import Problem
from megarl.config.schema import RunConfig

# Keys whose values are secrets: ``api_key``, ``hf_token``, ``secret``, ``db_password``, ... (the
# last word of the key decides, so ``max_tokens`` or ``tokenizer_path`` stay visible).
SECRET_KEY = re.compile(r"(^|[_.-])(api_?key|access_?key|secret(_?key)?|token|password|passwd|"
                        r"credentials?|auth)$", re.IGNORECASE)
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")


def is_secret_key(key: Any) -> bool:
    """Whether a config or mapping key names a credential."""
    return isinstance(key, str) and bool(SECRET_KEY.search(key))


def redact_secrets(value: Any) -> Any:
    """``value`` with credential-like keys masked and ``user:pass@`` removed from URLs."""
    if isinstance(value, Mapping):
        return {k: "***" if is_secret_key(k) and v else redact_secrets(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_secrets(v) for v in value)
    if isinstance(value, str):
        return _URL_CREDENTIALS.sub(r"\g<scheme>***@", value)
    return value


def yaml_scalar(value: Any) -> str:
    """One value in YAML flow style on one line (``null``, ``true``, ``[a, b]``, ``'x: y'``)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9, sort_keys=False).strip()
    return text.removesuffix("\n...").strip()


def _mark(path: str, sources: dict[str, str]) -> str:
    """The ``# from ...`` comment of a value, empty for schema defaults."""
    origin = sources.get(path)
    if origin is None:
        return ""
    return "  # derived" if origin == "derived" else f"  # from {origin}"


def _render_tree(tree: dict[str, Any], sources: dict[str, str], prefix: str,
                 indent: int) -> list[str]:
    """YAML lines of one mapping level."""
    lines: list[str] = []
    pad = " " * indent
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            lines.append(f"{pad}{key}:{_mark(path, sources)}")
            lines.extend(_render_tree(value, sources, path + ".", indent + 2))
        elif is_secret_key(key) and value:
            lines.append(f"{pad}{key}: null  # redacted secret: give it again ({path}=...)")
        else:
            lines.append(f"{pad}{key}: {yaml_scalar(redact_secrets(value))}"
                         f"{_mark(path, sources)}")
    return lines


def render_config(cfg: RunConfig, sources: dict[str, str]) -> str:
    """The resolved config as YAML with a source mark on every value that is not a default."""
    return "\n".join(_render_tree(cfg.model_dump(mode="json"), sources, "", 0)) + "\n"


def render_report(cfg: RunConfig, sources: dict[str, str], sizes: DerivedSizes,
                  problems: list[Problem], title: str = "",
                  estimates: list[str] | None = None) -> str:
    """Config, derived sizes, estimates, errors and warnings: what ``megarl config show`` prints."""
    out: list[str] = []
    if title:
        out.append(f"# {title}")
    out.append("# marks: '# from FILE' / '# from override' = set there; '# derived' = follows "
               "another field; unmarked = default")
    out.append(render_config(cfg, sources).rstrip("\n"))
    out.append("")
    out.append("# derived sizes")
    out.extend(f"#   {line}" for line in format_sizes(sizes))
    if estimates is not None:
        out.append("# estimates (approximate, per GPU; GB = 2^30 bytes; formulas in "
                   "megarl/config/estimates.py)")
        out.extend(f"#   {line}" for line in estimates)
    for severity, label in (("error", "errors"), ("warning", "warnings")):
        chosen = [p for p in problems if p.severity == severity]
        if chosen:
            out.append(f"# {label} ({len(chosen)})")
            out.extend(f"#   {p.line()}" for p in chosen)
    return "\n".join(out) + "\n"
