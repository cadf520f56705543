"""Loading a job file: read it, apply `--set` overrides, validate it into a `JobSpec`, and say
what is wrong in the user's terms.

`load_job(path, overrides)` returns a `JobSpec` or raises `UserError` listing every problem at
once, each as `FILE:LINE: dotted.path: message` (or `--set KEY: ...` for an override). The
model itself, its fields and their rules are `deploy.spec`; this module turns pydantic's
errors into those lines (did-you-mean hints for unknown fields, plain words for type errors).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from deploy.errors import FieldProblem, UserError
from deploy.problems import Problems
from deploy.spec import JobSpec, close_matches
from deploy.yamlfile import load_scalar, load_yaml, locate, read_text

#: Overrides: `--set` assignments (`["nodes=4"]`, values typed as YAML), or a mapping of
#: dotted keys to values already typed (`{"nodes": 4, "env.LR": "1.10"}`, the Python API's).
Overrides = Mapping[str, Any] | Iterable[str]


def parse_assignment(assignment: str) -> tuple[str, Any]:
    """`a.b.c=value` as (key, value), the value typed as YAML (env values as written)."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise UserError(f"--set {assignment}: expected KEY=VALUE, e.g. --set nodes=4")
    key = key.strip()
    try:
        value = load_scalar(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if len(key.split(".")) == 2 and key.startswith("env."):
        value = raw  # env values are strings exactly as written: --set env.LR=1.10 is "1.10"
    return key, value


def apply_override(data: dict, key: str, value: Any) -> None:
    """Set the field at dotted `key` (list entries by index) of the raw job mapping."""
    parts = key.split(".")
    node: Any = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise UserError(f"--set {key}: {'.'.join(parts[:i])} has {len(node)} entries; "
                                f"{part!r} is not an index into it")
            part = int(part)
        elif not isinstance(node, dict):
            raise UserError(f"--set {key}: {'.'.join(parts[:i])} is not a mapping")
        if last:
            node[part] = value
        else:
            if isinstance(node, dict) and not isinstance(node.get(part), (dict, list)):
                node[part] = {}
            node = node[part]


def overrides_of(overrides: Overrides) -> list[tuple[str, Any]]:
    """(key, value) pairs of either form."""
    if isinstance(overrides, Mapping):
        return [(str(k), v) for k, v in overrides.items()]
    return [parse_assignment(a) for a in overrides]


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The model class whose fields are valid at `loc` (for did-you-mean hints)."""
    model: Any = JobSpec
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return None
        model = unwrap_model(field.annotation)
        if model is None:
            return None
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None



def unwrap_model(annotation: Any) -> type[BaseModel] | None:
    """The model class inside an annotation such as `Volume`, `list[Volume]` or `NFS | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = unwrap_model(arg)
        if found:
            return found
    return None



def _message(err: dict) -> str:
    kind, loc, msg = err["type"], err["loc"], err["msg"]
    if kind == "extra_forbidden":
        model = _model_at(loc[:-1])
        valid = sorted(model.model_fields) if model else []
        close = close_matches(str(loc[-1]), valid, n=1, cutoff=0.6)
        hint = f", did you mean '{close[0]}'?" if close else (
            f"; valid: {', '.join(valid)}" if valid else "")
        return f"unknown field{hint}"
    if kind == "missing":
        return "required field is missing"
    if kind in ("value_error", "assertion_error"):
        return msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if kind == "literal_error":
        return msg.replace("Input should be", "must be one of")
    if kind in ("int_type", "int_parsing", "int_from_float"):
        got = err.get("input")
        return (f"expected an integer (got {type(got).__name__} {got!r:.40}); write a whole "
                "number without quotes")
    if kind.endswith("_type") or kind.endswith("_parsing"):
        got = err.get("input")
        return f"{msg.replace('Input should be', 'expected')} (got {type(got).__name__} {got!r:.40})"
    return msg.replace("Input should be", "must be")



def _clean_loc(loc: tuple) -> tuple:
    # pydantic adds the validator/type name for unions and function validators; drop those
    return tuple(p for p in loc if isinstance(p, int) or not re.search(r"[\[\]()]|^function-", str(p)))



def validation_problems(exc: ValidationError, source: str, lines: dict, overridden: set) -> list[str]:
    problems = []
    for err in exc.errors():
        loc = _clean_loc(err["loc"])
        error = (err.get("ctx") or {}).get("error")
        if isinstance(error, Problems):
            found = [(loc + tuple(int(p) if p.isdigit() else p for p in problem.path.split(".")),
                      problem.text) for problem in error.problems]
        else:
            found = [(loc, _message(err))]
        for where_loc, message in found:
            dotted = ".".join(str(p) for p in where_loc) or "(top level)"
            line = FieldProblem(locate(where_loc, source, lines, overridden), dotted, message)
            if line not in problems:
                problems.append(line)
    return problems



def parse_job(data: Any, *, source: str = "job.yaml", lines: dict | None = None,
              overrides: Overrides = ()) -> JobSpec:
    """Build a JobSpec from an already-parsed mapping (after applying overrides)."""
    if not isinstance(data, dict):
        raise UserError(f"{source}: a job file is a YAML mapping (name: ..., image: ...), "
                        f"not a {type(data).__name__}")
    overridden = set()
    for key, value in overrides_of(overrides):
        apply_override(data, key, value)
        overridden.add(tuple(int(p) if p.isdigit() else p for p in key.split(".")))
    try:
        job = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise UserError(*validation_problems(exc, source, lines or {}, overridden)) from None
    job._origin = (source, lines or {}, frozenset(overridden))
    return job



def load_job(path: str, overrides: Overrides = ()) -> JobSpec:
    """Read, override and validate a job file. Raises UserError listing every problem."""
    text = read_text(path)
    data, lines = load_yaml(text, str(path))
    return parse_job(data, source=str(path), lines=lines, overrides=overrides)
