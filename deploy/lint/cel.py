"""A CRD's `x-kubernetes-validations` (CEL) rules, evaluated as kube-apiserver does on create.

Evaluator: `common-expression-language` (Rust `cel` crate bindings; it evaluated every rule of
the bundled CRDs like the API server and is ~5x faster than `cel-python`; part of the `k8s`
extra). On create, transition rules (those reading `oldSelf`) are not evaluated unless
`optionalOldSelf` is true, when `oldSelf` is absent (kubernetes apiextensions
`pkg/apiserver/schema/cel/validation.go`). A rule that is false gives its `message` (or its
`messageExpression`, else "failed rule: RULE") at `fieldPath` under the node, reason Invalid
unless `reason` says otherwise; a rule the evaluator cannot run is an error, as on the server.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from deploy.kube.finding import LintInputError

_programs: dict[str, Any] = {}
_REASONS = {"FieldValueRequired": "Required value", "FieldValueForbidden": "Forbidden",
            "FieldValueDuplicate": "Duplicate value"}


_evaluator: Any = None


def _cel() -> Any:
    """The package's compiled evaluator, loaded without `cel/__init__.py`, which imports the
    package's interactive CLI (prompt_toolkit, typer: ~0.9 s, a third of a lint run)."""
    global _evaluator
    if _evaluator is None:
        import importlib.machinery
        import importlib.util
        import sys

        spec = importlib.util.find_spec("cel")
        if spec is None or not spec.submodule_search_locations:
            raise LintInputError("CEL rules need common-expression-language: pip install 'ddpkit[k8s]'")
        if "cel" in sys.modules:
            _evaluator = sys.modules["cel"]
        else:
            folder = Path(list(spec.submodule_search_locations)[0])
            binary = next(folder.glob("cel.*" + importlib.machinery.EXTENSION_SUFFIXES[0].rpartition(".")[2]), None)
            loader = importlib.machinery.ExtensionFileLoader("cel.cel", str(binary)) if binary else None
            if loader is None:
                import cel as package
                _evaluator = package
            else:
                module = importlib.util.module_from_spec(importlib.util.spec_from_loader("cel.cel", loader))
                loader.exec_module(module)
                _evaluator = module
    return _evaluator


def _compile(rule: str) -> Any:
    program = _programs.get(rule)
    if program is None:
        program = _programs[rule] = _cel().compile(rule)
    return program


def _reads_old_self(rule: str) -> bool:
    return re.search(r"\boldSelf\b", rule) is not None


def check(rules: list[dict], value: Any, schema: dict) -> list[tuple[list, str]]:
    """(relative path parts, message) for every rule `value` fails."""
    found = []
    for rule in rules or []:
        text = rule.get("rule", "")
        if _reads_old_self(text) and not rule.get("optionalOldSelf"):
            continue  # a transition rule: only evaluated on update
        try:
            ok = _compile(text).execute({"self": value})
        except (ValueError, TypeError, RuntimeError, KeyError) as exc:
            found.append(([], f"Invalid value: \"object\": rule {text!r}: evaluation error: {exc}"))
            continue
        if ok is True:
            continue
        message = rule.get("message") or ""
        if not message and rule.get("messageExpression"):
            try:
                message = str(_compile(rule["messageExpression"]).execute({"self": value}))
            except (ValueError, TypeError, RuntimeError, KeyError):
                message = ""
        message = message or f"failed rule: {text}"
        reason = _REASONS.get(rule.get("reason", ""), "Invalid value")
        prefix = f"{reason}: " if reason != "Invalid value" else f"Invalid value: \"{_kind(value)}\": "
        found.append((_field_path(rule.get("fieldPath", "")), prefix + message))
    return found


def _kind(value: Any) -> str:
    """The API server's name for the value's type in `Invalid value: "TYPE": ...`."""
    if isinstance(value, bool):
        return "boolean"
    return {dict: "object", list: "array", str: "string", int: "integer", float: "number"}.get(type(value), "object")


def _field_path(field_path: str) -> list:
    """`.spec.replicas` or `.a['b'][0]` as path parts."""
    return [m.group(1) or m.group(2) or int(m.group(3))
            for m in re.finditer(r"\.([A-Za-z0-9_-]+)|\['([^']*)'\]|\[(\d+)\]", field_path)]
