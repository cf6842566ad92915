"""Loading a run config: YAML file + ``a.b.c=value`` overrides -> :class:`RunConfig`.

Precedence: command-line overrides > YAML file > schema defaults. Every value that did not come
from the defaults is recorded in ``sources`` (dotted path -> the file, ``override`` or
``derived``), which ``megarl config show`` prints. Every problem becomes one line
``field.path: what is wrong — fix``: unknown keys get the nearest valid names (verl's names are
translated), type errors say what was expected.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from megarl.config.render import is_secret_key
from megarl.config.schema import DERIVED_FIELDS, RunConfig

Sources = dict[str, str]
OVERRIDE = "override"
DERIVED = "derived"

_KEY_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")

# verl key prefixes and names -> megarl's, used only to suggest the right key.
VERL_PREFIXES: tuple[tuple[str, str], ...] = (
    ("actor_rollout_ref.actor.megatron.", "actor.parallel."),
    ("actor_rollout_ref.ref.megatron.", "ref.parallel."),
    ("actor_rollout_ref.rollout.checkpoint_engine.", "checkpoint_engine."),
    ("actor_rollout_ref.actor.", "actor."),
    ("actor_rollout_ref.rollout.", "rollout."),
    ("actor_rollout_ref.ref.", "ref."),
    ("actor_rollout_ref.model.", "model."),
    ("rollout.checkpoint_engine.", "checkpoint_engine."),
    ("actor.megatron.", "actor.parallel."),
    ("ref.megatron.", "ref.parallel."),
    ("critic.megatron.", "critic.parallel."),
    ("async_training.", "scheduler."),
    ("ray_init.", "ray."),
    ("custom_reward_function.", "reward."),
)
VERL_PARALLEL_NAMES = {
    "tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
    "virtual_pipeline_model_parallel_size": "vpp", "expert_model_parallel_size": "ep",
    "expert_tensor_parallel_size": "etp", "context_parallel_size": "cp",
}
VERL_NAMES = {
    "rollout.tensor_model_parallel_size": "rollout.gpus_per_engine",
    "rollout.name": "rollout.backend",
    "rollout.mem_fraction_static": "rollout.gpu_memory_utilization",
    "rollout.max_running_requests": "rollout.max_num_seqs",
    "rollout.enable_rollout_routing_replay": "rollout.enable_return_routed_experts",
    "rollout.update_weights_bucket_megabytes": "checkpoint_engine.bucket_size_mb",
    "rollout.log_prob_micro_batch_size_per_gpu": "actor.log_prob_micro_batch_size_per_gpu",
    "rollout.log_prob_max_token_len_per_gpu": "actor.log_prob_max_token_len_per_gpu",
    "actor.optim.clip_grad": "actor.grad_clip",
    "trainer.n_gpus_per_node": "resources.train_pool.gpus_per_node",
    "trainer.nnodes": "resources.train_pool.nnodes",
    "trainer.logger": "trainer.loggers",
    "trainer.save_freq": "trainer.save_every",
    "trainer.test_freq": "trainer.val_every",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.default_local_dir": "trainer.output_dir",
    "trainer.resume_mode": "trainer.resume",
    "trainer.max_actor_ckpt_to_keep": "trainer.keep_last",
    "ray.timeline_json_file": "ray.timeline_file",
    "reward.path": "reward.function",
}


class ConfigError(ValueError):
    """The config cannot be loaded; ``lines`` holds one ``field: what — fix`` line per problem."""

    def __init__(self, lines: Sequence[str]) -> None:
        self.lines = list(lines)
        super().__init__("\n".join(self.lines))


# ---------------------------------------------------------------------------------------------
# The schema as dotted paths


def section_type(annotation: Any) -> type[BaseModel] | None:
    """The config section class inside a field annotation (``X``, ``X | None``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = section_type(arg)
            if found is not None:
                return found
    return None


def schema_fields(model: type[BaseModel] = RunConfig, prefix: str = "") -> dict[str, FieldInfo]:
    """Every field of the schema by dotted path, sections included, in declaration order."""
    out: dict[str, FieldInfo] = {}
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        out[path] = info
        sub = section_type(info.annotation)
        if sub is not None:
            out.update(schema_fields(sub, path + "."))
    return out


_FIELDS = schema_fields()


def field_default(path: str) -> Any:
    """The schema default of a field (None when it has no default)."""
    info = _FIELDS.get(path)
    if info is None or info.is_required():
        return None
    return info.get_default(call_default_factory=True, validated_data={})


# ---------------------------------------------------------------------------------------------
# Suggestions for unknown keys


def _translate_verl(path: str) -> str:
    """verl's name for a key, translated to megarl's (unchanged when there is none)."""
    for old, new in VERL_PREFIXES:
        if path.startswith(old):
            path = new + path[len(old):]
            break
    path = VERL_NAMES.get(path, path)
    parent, _, leaf = path.rpartition(".")
    if parent.endswith("parallel") and leaf in VERL_PARALLEL_NAMES:
        path = f"{parent}.{VERL_PARALLEL_NAMES[leaf]}"
    return path


def suggest_keys(path: str, limit: int = 3) -> list[str]:
    """Valid dotted paths nearest to an unknown ``path``, best first."""
    translated = _translate_verl(path)
    if translated != path and translated in _FIELDS:
        return [translated]
    parent, _, leaf = path.rpartition(".")
    top = path.split(".")[0]
    same_leaf = [p for p in _FIELDS if p.rpartition(".")[2] == leaf]
    if same_leaf:  # the key exists, in another section: prefer the same top-level section
        same_leaf.sort(key=lambda p: (p.split(".")[0] != top, len(p)))
        return same_leaf[:limit]
    siblings = [p.rpartition(".")[2] for p in _FIELDS if p.rpartition(".")[0] == parent]
    close = _closest(leaf, siblings, limit)
    if close:
        return [f"{parent}.{c}" if parent else c for c in close]
    return _closest(path, list(_FIELDS), limit)


def _closest(word: str, candidates: list[str], limit: int) -> list[str]:
    """The best difflib matches, keeping only those about as close as the best one."""
    scored = sorted(((difflib.SequenceMatcher(None, word, c).ratio(), c) for c in candidates),
                    reverse=True)
    if not scored or scored[0][0] < 0.6:
        return []
    return [c for score, c in scored[:limit] if score >= scored[0][0] - 0.05]


def _unknown_key_line(path: str, origin: str) -> str:
    """The line for a key that is not in the schema."""
    close = suggest_keys(path)
    where = f" (in {origin})" if origin else ""
    if close:
        return f"{path}: unknown key{where} — did you mean {' or '.join(close)}?"
    parent = path.rpartition(".")[0]
    while parent and parent not in _FIELDS:  # the nearest ancestor that is a real section
        parent = parent.rpartition(".")[0]
    siblings = [p.rpartition(".")[2] for p in _FIELDS if p.rpartition(".")[0] == parent]
    scope = f"keys of {parent}" if parent else "top-level sections"
    return f"{path}: unknown key{where} — valid {scope}: {', '.join(siblings)}"


# ---------------------------------------------------------------------------------------------
# Pydantic errors -> one line per field


def _error_path(loc: tuple[Any, ...]) -> str:
    """The dotted field path of a pydantic error location (union tags dropped)."""
    parts: list[str] = []
    model: type[BaseModel] | None = RunConfig
    for item in loc:
        if isinstance(item, int):
            parts.append(str(item))
        elif model is not None and item in model.model_fields:
            parts.append(item)
            model = section_type(model.model_fields[item].annotation)
    return ".".join(parts)


def _expected(err: Mapping[str, Any]) -> str:
    """What the field wanted, for type errors."""
    kind, ctx = err["type"], err.get("ctx") or {}
    names = {
        "int": "a whole number", "float": "a number", "bool": "true or false",
        "string": "a string", "list": "a list", "tuple": "a list", "dict": "a mapping",
        "model": "a mapping of its fields",
    }
    if kind == "literal_error":
        return f"one of {ctx.get('expected', '?')}"
    return names.get(kind.split("_")[0], err["msg"].removeprefix("Input should be "))


def _bound(err: Mapping[str, Any]) -> str | None:
    """``'>= 1'`` style text for range errors, None for other errors."""
    ctx = err.get("ctx") or {}
    for key, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        if key in ctx:
            return f"{op} {ctx[key]}"
    return None


def _literal_hint(err: Mapping[str, Any]) -> str:
    """``did you mean 'x'?`` for a misspelt literal choice."""
    expected = re.findall(r"'([^']*)'", (err.get("ctx") or {}).get("expected", ""))
    close = difflib.get_close_matches(str(err["input"]), expected, n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _field_line(path: str, errs: list[Mapping[str, Any]], origin: str) -> str:
    """One line for all errors of one field (a union field reports one error per member)."""
    where = f" (from {origin})" if origin else ""
    first = errs[0]
    default = field_default(path)
    example = f", e.g. {path}={yaml.safe_dump(default, default_flow_style=True).strip()}" if (
        default is not None and not isinstance(default, (BaseModel, dict))) else ""
    example = example.removesuffix("\n...")
    kind = first["type"]
    given = "'***' (a secret, not shown)" if is_secret_key(path.rpartition(".")[2]) else (
        repr(first["input"]))
    if kind == "missing":
        return f"{path}: required but not set — add it to the YAML file or pass {path}=VALUE"
    bound = _bound(first)
    if bound is not None:
        return (f"{path}: {given}{where} is out of range, it must be {bound} — "
                f"use a value {bound}{example}")
    if kind == "value_error":
        reason = str((first.get("ctx") or {}).get("error", first["msg"]))
        return f"{path}: {reason}{where} — fix the value{example}"
    if kind in ("too_long", "too_short"):
        return f"{path}: {first['msg'].lower()}{where} — give the right number of items{example}"
    expected = " or ".join(dict.fromkeys(_expected(e) for e in errs))
    hint = "".join(_literal_hint(e) for e in errs if e["type"] == "literal_error")
    return (f"{path}: {given}{where} is not {expected}{hint} — "
            f"use {expected}{example}")


def _origin_of(path: str, sources: Sources) -> str:
    """Where the value at ``path`` (or its nearest set parent) came from."""
    while path:
        if path in sources:
            return sources[path]
        path = path.rpartition(".")[0]
    return ""


def validation_error_lines(err: ValidationError, sources: Sources) -> list[str]:
    """Convert a pydantic ValidationError into one line per offending field."""
    by_path: dict[str, list[Mapping[str, Any]]] = {}
    lines: list[str] = []
    for e in err.errors():
        if e["type"] == "extra_forbidden":
            path = ".".join(filter(None, [_error_path(e["loc"][:-1]), str(e["loc"][-1])]))
            given = e["input"]  # an unknown section: report each key inside it
            leaves = flatten(given, path + ".") if isinstance(given, Mapping) and given else {
                path: given}
            lines.extend(_unknown_key_line(p, _origin_of(p, sources)) for p in leaves)
        else:
            by_path.setdefault(_error_path(e["loc"]), []).append(e)
    for path, errs in by_path.items():
        lines.append(_field_line(path, errs, _origin_of(path, sources)))
    return lines


# ---------------------------------------------------------------------------------------------
# YAML, overrides, merging


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML config file; ConfigError with one line when it cannot be read."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError([f"{path}: no such config file — check the path"]) from None
    except OSError as err:
        raise ConfigError([f"{path}: cannot be read ({err.strerror}) — check permissions"]) from err
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError([f"{path}:{where}: YAML syntax error: {problem} — fix the file"]) from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([(f"{path}: the top level is a {type(data).__name__}, not a mapping of "
                           f"sections — write `model:`, `data:`, ... at the top level")])
    return data


def parse_override(text: str) -> tuple[str, Any]:
    """``"a.b.c=value"`` -> ``("a.b.c", value)``, the value parsed as a YAML scalar or list."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not _KEY_RE.fullmatch(key):
        raise ConfigError([(f"{text}: not an override — write dotted.key=value, e.g. "
                           f"data.train_batch_size=32")])
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError([f"{key}: value {raw!r} is not valid YAML ({err}) — quote it"]) from err
    return key, value


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """Set ``tree[a][b][c] = value`` for ``key = "a.b.c"``, creating mappings on the way."""
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    if isinstance(value, dict) and isinstance(node.get(leaf), dict):
        deep_merge(node[leaf], value)
    else:
        node[leaf] = value


def deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Merge ``update`` into ``base`` in place (mappings merged, everything else replaced)."""
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            deep_merge(base[key], value)
        else:
            base[key] = dict(value) if isinstance(value, Mapping) else value
    return base


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Leaf values of a nested mapping by dotted path (lists are leaves)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


# ---------------------------------------------------------------------------------------------
# Entry points


def load_config_dict(
    data: Mapping[str, Any], overrides: Iterable[str] = (), origin: str = "<dict>"
) -> tuple[RunConfig, Sources]:
    """Build a RunConfig from a mapping (as if read from ``origin``) plus overrides."""
    tree = deep_merge({}, data)
    sources: Sources = {path: origin for path in flatten(tree)}
    problems: list[str] = []
    for text in overrides:
        try:
            key, value = parse_override(text)
        except ConfigError as err:
            problems.extend(err.lines)
            continue
        _set_dotted(tree, key, value)
        if isinstance(value, Mapping):  # merged into the section: its other keys stay
            sources.update({p: OVERRIDE for p in flatten({key: value})})
        else:  # replaces whatever was there, a whole section included
            sources = {p: o for p, o in sources.items() if not p.startswith(key + ".")}
            sources[key] = OVERRIDE
    if problems:
        raise ConfigError(problems)
    try:
        cfg = RunConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(validation_error_lines(err, sources)) from None
    given = flatten(tree)
    for path in DERIVED_FIELDS:  # null or absent -> filled by RunConfig from another field
        if given.get(path) is None and not any(p.startswith(path + ".") for p in given):
            sources[path] = DERIVED
    return cfg, sources


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> tuple[RunConfig, Sources]:
    """Load a YAML config file with ``a.b.c=value`` overrides; raise ConfigError on problems."""
    return load_config_dict(read_yaml(path), overrides, origin=str(path))
