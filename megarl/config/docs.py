"""A Markdown table of the config fields (field, type, default, description) for README.md,
generated from the schema so the documentation cannot drift from the code."""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel

from megarl.config.loader import field_default, schema_fields, section_type
from megarl.config.render import yaml_scalar


def type_name(annotation: Any) -> str:
    """A short, readable name of a field type (``int``, ``'a' | 'b'``, ``list[str]``...)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def fields_table(sections: Iterable[str] | None = None) -> str:
    """Markdown table of the config fields (optionally only under the given top-level sections).

    A block that appears twice (``critic.optim`` is an ``actor.optim``) gets one row pointing
    to its first listing instead of repeating every field.
    """
    wanted = set(sections) if sections is not None else None
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    first_listing: dict[type[BaseModel], str] = {}
    skipped: list[str] = []
    for path, info in schema_fields().items():
        if any(path.startswith(prefix + ".") for prefix in skipped):
            continue
        sub = section_type(info.annotation)
        description = info.description or ""
        if sub is not None and sub in first_listing:
            skipped.append(path)
            description += f"; same fields as `{first_listing[sub]}`"
        elif sub is not None:
            first_listing[sub] = path
            if not (info.default is None and not info.is_required()):
                continue  # a section: its fields have their own rows
        if wanted is not None and path.split(".")[0] not in wanted:
            continue
        rows.append(f"| `{path}` | {_cell(type_name(info.annotation))} | `{_cell(_default(path))}` "
                    f"| {_cell(description)} |")
    return "\n".join(rows) + "\n"


def _default(path: str) -> str:
    """The default of a field as YAML text (``required`` when it has none)."""
    info = schema_fields()[path]
    if info.is_required():
        return "required"
    value = field_default(path)
    return yaml_scalar(value.model_dump(mode="json") if isinstance(value, BaseModel) else value)


DOC_HEADER = ("# megarl configuration reference\n\nGenerated from the schema (`megarl/config/`) "
              "by `python -m megarl.config.docs > docs/config.md`; a test keeps it in sync.\n\n")


def reference_page() -> str:
    """The whole of ``docs/config.md``."""
    return DOC_HEADER + fields_table() + "\n"


if __name__ == "__main__":
    print(reference_page(), end="")
