"""ObjectMeta validation, as kube-apiserver applies it, on the name rules of `deploy.kube`.

Ported from k8s.io/apimachinery v0.34 `pkg/api/validation/objectmeta.go` (ValidateObjectMeta,
ValidateAnnotations), messages kept; the field-error spellings (`invalid`, `required`, ...)
are apimachinery's `field.Error` strings.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from deploy.kube import (
    is_dns1123_label,
    is_dns1123_subdomain,
    is_label_value,
    is_qualified_name,
)
from deploy.kube.finding import Finding, join


def invalid(path: str, value: Any, message: str) -> Finding:
    """`field.Invalid`: the API server's `path: Invalid value: "v": message`."""
    return path, f"Invalid value: {_quote(value)}: {message}"


def required(path: str, message: str = "") -> Finding:
    return path, "Required value" + (f": {message}" if message else "")


def forbidden(path: str, message: str) -> Finding:
    return path, f"Forbidden: {message}"


def not_supported(path: str, value: Any, allowed: list) -> Finding:
    quoted = ", ".join(_quote(a) for a in allowed)
    return path, f"Unsupported value: {_quote(value)}: supported values: {quoted}"


def duplicate(path: str, value: Any) -> Finding:
    return path, f"Duplicate value: {_quote(value)}"


def _quote(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validate_labels(labels: Any, path: str) -> list[Finding]:
    if labels is None:
        return []
    if not isinstance(labels, dict):
        return [(path, "must be a map of strings")]
    found = []
    for key, value in labels.items():
        found += [invalid(path, key, e) for e in is_qualified_name(str(key))]
        if not isinstance(value, str):
            found.append((join(path, str(key)), "must be a string"))
        else:
            found += [invalid(join(path, str(key)), value, e) for e in is_label_value(value)]
    return found


_TOTAL_ANNOTATION_SIZE = 256 * 1024


def validate_annotations(annotations: Any, path: str) -> list[Finding]:
    if annotations is None:
        return []
    if not isinstance(annotations, dict):
        return [(path, "must be a map of strings")]
    found, size = [], 0
    for key, value in annotations.items():
        found += [invalid(path, key, e) for e in is_qualified_name(str(key).lower())]
        if not isinstance(value, str):
            found.append((join(path, str(key)), "must be a string"))
        else:
            size += len(str(key)) + len(value)
    if size > _TOTAL_ANNOTATION_SIZE:
        found.append((path, f"Too long: may not be more than {_TOTAL_ANNOTATION_SIZE} bytes"))
    return found


#: ObjectMeta's fields (k8s.io/apimachinery meta/v1 types.go); strict decoding refuses others.
OBJECT_META_FIELDS = frozenset({
    "name", "generateName", "namespace", "labels", "annotations", "finalizers", "ownerReferences",
    "uid", "resourceVersion", "generation", "creationTimestamp", "deletionTimestamp",
    "deletionGracePeriodSeconds", "managedFields", "selfLink",
})

NameRule = Callable[[str], list[str]]


def validate_object_meta(meta: Any, name_rule: NameRule = is_dns1123_subdomain,
                         path: str = "metadata", *, top_level: bool = True) -> list[Finding]:
    """ValidateObjectMeta: name (or generateName), namespace, labels, annotations.

    `top_level` also reports unknown ObjectMeta fields (strict field validation); embedded
    metadata (a pod template's) is schema-checked where it sits.
    """
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        return [(path, "must be an object")]
    found: list[Finding] = []
    if top_level:
        found += [(join(path, str(k)), "unknown field") for k in meta if k not in OBJECT_META_FIELDS]
    name, generate = meta.get("name"), meta.get("generateName")
    if top_level and not name and not generate:
        found.append(required(join(path, "name"), "name or generateName is required"))
    if isinstance(name, str) and name:
        found += [invalid(join(path, "name"), name, e) for e in name_rule(name)]
    elif name is not None and not isinstance(name, str):
        found.append((join(path, "name"), "must be a string"))
    if isinstance(generate, str) and generate:
        stem = generate[:-1] if generate.endswith("-") else generate
        found += [invalid(join(path, "generateName"), generate, e) for e in name_rule(stem)
                  if not e.startswith("must be no more")]
    namespace = meta.get("namespace")
    if isinstance(namespace, str) and namespace:
        found += [invalid(join(path, "namespace"), namespace, e) for e in is_dns1123_label(namespace)]
    found += validate_labels(meta.get("labels"), join(path, "labels"))
    found += validate_annotations(meta.get("annotations"), join(path, "annotations"))
    return found


_HTTP_PATH = re.compile(r"^[A-Za-z0-9/\-._~%!$&'()*+,;=:]+$")


def is_domain_prefixed_path(path: str, value: Any) -> list[Finding]:
    """IsDomainPrefixedPath: `acme.io/foo` (managedBy fields, runtime patch managers)."""
    if not value:
        return [required(path)]
    host, slash, rest = str(value).partition("/")
    if not slash or not host or not rest:
        return [invalid(path, value, 'must be a domain-prefixed path (such as "acme.io/foo")')]
    found = [invalid(path, host, e) for e in is_dns1123_subdomain(host)]
    if not _HTTP_PATH.match(rest):
        found.append(invalid(path, rest, "Invalid path (regex used for validation is "
                             "'[A-Za-z0-9/\\-._~%!$&'()*+,;=:]+')"))
    return found
