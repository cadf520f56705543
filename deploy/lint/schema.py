"""Custom resources against their CRD, in the order kube-apiserver handles a create.

1. **Pruning** (apiextensions-apiserver `pkg/apiserver/schema/pruning`): a field the structural
   schema does not specify is unknown. kubectl's default `--validate=strict` asks the server for
   strict field validation, which refuses the object naming every unknown field; a server
   asked for `Ignore` would drop them silently. Nulls of non-nullable fields are dropped.
2. **Defaulting** (`pkg/apiserver/schema/defaulting`): every `default` of the schema fills a
   missing field; the mutating webhooks then run on the defaulted object (see `admission`).
3. **Validation**: the OpenAPI v3 value rules (type, enum, pattern, bounds, required, ...)
   checked by `jsonschema`'s Draft 4 validator (OpenAPI 3.0 schema objects are Draft 4 with
   boolean exclusive bounds), extended with the `x-kubernetes-*` keywords the API server
   implements: `int-or-string`, `nullable`, `list-type` set/map uniqueness and `validations`
   (CEL, see `deploy.lint.cel`); integer formats int32/int64 are range-checked (the webhooks
   decode into Go int32/int64 and refuse what overflows). A fast pass (`_holds`) first walks
   the object alone: what it shows to break no rule is not given to jsonschema, which is then
   imported only for an object it is not sure of, to judge it and word the errors (`ddpkit
   render` lints the objects it renders, and jsonschema's import was a third of its time).

CRDs come bundled (`deploy/lint/crds/`, the upstream files of the versions ddpkit targets) and
from `--crds DIR` (a cluster's own `kubectl get crd NAME -o yaml`), which take precedence.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from deploy.kube.core import JSON_TYPES, same_in_enum, type_holds
from deploy.kube.finding import Finding, LintInputError, join, short
from deploy.lint import cel
from deploy.yamlfile import load_documents

if TYPE_CHECKING:
    import jsonschema

BUNDLED_CRDS = Path(__file__).resolve().parent / "crds"

# --------------------------------------------------------------------------------------------
# 1. Pruning


def prune(value: Any, schema: dict | None, path: str = "", *, root: bool = True) -> tuple[Any, list[str]]:
    """(value without unknown fields, the paths of those fields), as the structural pruner."""
    unknown: list[str] = []
    return _prune(value, schema, path, unknown, root), unknown


def _prune(value: Any, schema: dict | None, path: str, unknown: list[str], root: bool = False) -> Any:
    if schema is not None and schema.get("x-kubernetes-preserve-unknown-fields") is True:
        return _prune_known(value, schema, path, unknown)
    if isinstance(value, dict):
        out = {}
        props = (schema or {}).get("properties") or {}
        extra = (schema or {}).get("additionalProperties")
        embedded = (schema or {}).get("x-kubernetes-embedded-resource") is True
        for key, child in value.items():
            sub = join(path, str(key))
            if (root or embedded) and key in ("apiVersion", "kind", "metadata"):
                out[key] = child
            elif schema is not None and key in props:
                if child is None and not _keeps_null(props[key]):
                    continue
                out[key] = _prune(child, props[key], sub, unknown)
            elif schema is not None and isinstance(extra, dict):
                out[key] = _prune(child, extra, sub, unknown)
            elif schema is not None and extra is True:
                out[key] = child
            else:
                unknown.append(sub)
        return out
    if isinstance(value, list):
        items = (schema or {}).get("items")
        return [_prune(child, items if isinstance(items, dict) else None, join(path, i), unknown)
                for i, child in enumerate(value)]
    return value


def _prune_known(value: Any, schema: dict, path: str, unknown: list[str]) -> Any:
    """Under x-kubernetes-preserve-unknown-fields: keep unknown keys, prune inside known ones."""
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        return {k: (_prune(v, props[k], join(path, str(k)), unknown) if k in props else
                    _prune(v, extra, join(path, str(k)), unknown) if isinstance(extra, dict) else v)
                for k, v in value.items()}
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_prune(v, schema["items"], join(path, i), unknown) for i, v in enumerate(value)]
    return value


def _keeps_null(schema: dict) -> bool:
    return schema.get("nullable") is True or "default" in schema


# --------------------------------------------------------------------------------------------
# 2. Defaulting


def apply_defaults(value: Any, schema: dict | None) -> None:
    """Fill missing (or null) fields from the schema's `default`s, in place, depth first."""
    if not schema:
        return
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for key, prop in props.items():
            if "default" in prop and (key not in value or (value[key] is None and not prop.get("nullable"))):
                value[key] = copy.deepcopy(prop["default"])
        extra = schema.get("additionalProperties")
        for key, child in value.items():
            if key in props:
                apply_defaults(child, props[key])
            elif isinstance(extra, dict):
                apply_defaults(child, extra)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for child in value:
            apply_defaults(child, schema["items"])


# --------------------------------------------------------------------------------------------
# 3. Validation: jsonschema's Draft 4 plus the x-kubernetes-* keywords


def _is_integer(_checker, value) -> bool:
    # kube-openapi accepts a JSON number with an integral value as an integer (1.0).
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer())


_INT_RANGE = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


def _type(validator, types, instance, schema):
    from jsonschema import ValidationError

    if instance is None and schema.get("nullable") is True:
        return
    if schema.get("x-kubernetes-int-or-string") is True:
        if not (validator.is_type(instance, "integer") or isinstance(instance, str)):
            yield ValidationError(f"must be an integer or a string, got {short(instance)}")
        return
    types = [types] if isinstance(types, str) else types
    if not any(validator.is_type(instance, t) for t in types):
        yield ValidationError(f"Invalid value: {_json_type(instance)}: must be of type {', '.join(types)}")


def _format(validator, fmt, instance, schema):
    from jsonschema import ValidationError

    bounds = _INT_RANGE.get(fmt)
    if bounds and validator.is_type(instance, "integer") and not bounds[0] <= instance <= bounds[1]:
        yield ValidationError(f"Invalid value: {instance}: out of range for {fmt}")


def _duplicates(list_type: str, instance: list, schema: dict) -> list[tuple[int, str]]:
    """(index, message) of each item an `x-kubernetes-list-type` set or map has twice."""
    found = []
    if list_type == "set":
        seen: list = []
        for i, item in enumerate(instance):
            if item in seen:
                found.append((i, f"Duplicate value: {short(item)}"))
            seen.append(item)
    elif list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys") or []
        seen_keys: set = set()
        for i, item in enumerate(instance):
            if not isinstance(item, dict):
                continue
            key = tuple(repr(item.get(k)) for k in keys)
            if key in seen_keys:
                shown = ", ".join(f"{k}={short(item.get(k))}" for k in keys)
                found.append((i, f"Duplicate value: map[{shown}]"))
            seen_keys.add(key)
    return found


def _list_type(validator, list_type, instance, schema):
    from jsonschema import ValidationError

    if isinstance(instance, list):
        for i, message in _duplicates(list_type, instance, schema):
            yield ValidationError(message, path=[i])


def _cel_rules(validator, rules, instance, schema):
    from jsonschema import ValidationError

    for path, message in cel.check(rules, instance, schema):
        yield ValidationError(message, path=path)


def _ignore(validator, value, instance, schema):
    return iter(())


@cache
def _validators() -> tuple[type, type]:
    """(structural, typed) jsonschema validator classes, made on first use: jsonschema's import
    alone is a third of a `ddpkit render k8s`, and `_holds` spares most objects the need."""
    import jsonschema
    from jsonschema import Draft4Validator

    keywords = dict(Draft4Validator.VALIDATORS)
    keywords.update({
        "type": _type,
        "format": _ignore,  # kube-openapi checks string formats the CRDs here do not use
        "x-kubernetes-list-type": _list_type,
        "x-kubernetes-validations": _cel_rules,
    })
    keywords.pop("$ref", None)  # structural schemas have no references
    structural = jsonschema.validators.create(
        meta_schema=Draft4Validator.META_SCHEMA, validators=keywords,
        type_checker=Draft4Validator.TYPE_CHECKER.redefine("integer", _is_integer),
        version="kubernetes-structural")
    # The same, plus what a webhook's typed decode refuses: integers beyond their Go type
    # (`format: int32` into an int32 field). The API server alone does not range-check them.
    return structural, jsonschema.validators.extend(structural, {"format": _format})


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


def validate_values(value: Any, schema: dict, path: str = "", *, typed: bool = False) -> list[tuple[str, str, str]]:
    """(path, message, rule) of every value-rule violation of a pruned and defaulted object;
    rule is `cel` for x-kubernetes-validations, `webhook` for what only a webhook's typed decode
    refuses (`typed`: the kind has a webhook), else `schema`."""
    if _holds(value, schema, typed):
        return []  # what jsonschema would find too
    structural, typed_validator = _validators()
    found = []
    for error in (typed_validator if typed else structural)(schema).iter_errors(value):
        where = path
        for part in error.absolute_path:
            where = join(where, part)
        rule = {"x-kubernetes-validations": "cel", "format": "webhook"}.get(error.validator, "schema")
        found.append((*_finding(error, where), rule))
    return sorted(set(found))


# The fast pass: most objects break no rule, and showing that needs no jsonschema.

#: The keywords jsonschema's Draft 4 validator acts on (Draft4Validator.VALIDATORS: a test holds
#: them equal); `_validators` drops `$ref` and adds two. Any other key of a schema is skipped.
DRAFT4_KEYWORDS = frozenset({
    "$ref", "additionalItems", "additionalProperties", "allOf", "anyOf", "dependencies", "enum",
    "format", "items", "maxItems", "maxLength", "maxProperties", "maximum", "minItems", "minLength",
    "minProperties", "minimum", "multipleOf", "not", "oneOf", "pattern", "patternProperties",
    "properties", "required", "type", "uniqueItems"})
_ACTIVE = DRAFT4_KEYWORDS - {"$ref"} | {"x-kubernetes-list-type", "x-kubernetes-validations"}
_BOUNDS = {"minLength": (str, False), "maxLength": (str, True), "minItems": (list, False),
           "maxItems": (list, True), "minProperties": (dict, False), "maxProperties": (dict, True)}


def _holds(value: Any, schema: Any, typed: bool) -> bool:
    """True when `value` certainly breaks no rule of `schema`: validate_values' jsonschema pass
    would find nothing. False is "not sure" (a keyword this does not judge, a value it does not
    compare exactly), and jsonschema then judges, and words the errors."""
    if not isinstance(schema, dict) or not isinstance(value, JSON_TYPES):
        return False
    for key, arg in schema.items():
        if key not in _ACTIVE:
            continue
        if key == "type":
            if value is None and schema.get("nullable") is True:
                continue
            if schema.get("x-kubernetes-int-or-string") is True:
                ok = _is_integer(None, value) or isinstance(value, str)
            else:  # IS_TYPE's integer is kube-openapi's, as _is_integer
                ok = type_holds(arg, value)
        elif key == "properties":
            ok = isinstance(arg, dict) and (not isinstance(value, dict) or all(
                _holds(value[k], sub, typed) for k, sub in arg.items() if k in value))
        elif key == "additionalProperties":
            known = schema.get("properties", {})
            if not isinstance(value, dict):
                ok = True
            elif not isinstance(known, dict) or "patternProperties" in schema:
                ok = False
            elif isinstance(arg, dict):
                ok = all(_holds(v, arg, typed) for k, v in value.items() if k not in known)
            else:
                ok = bool(arg) or all(k in known for k in value)
        elif key == "items":
            ok = not isinstance(value, list) or (isinstance(arg, dict) and all(_holds(v, arg, typed) for v in value))
        elif key == "required":
            ok = isinstance(arg, list) and (not isinstance(value, dict) or all(k in value for k in arg))
        elif key == "enum":
            ok = same_in_enum(value, arg)
        elif key == "pattern":
            ok = isinstance(arg, str) and (not isinstance(value, str) or re.search(arg, value) is not None)
        elif key in ("minimum", "maximum"):
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number:
                ok = True
            elif not isinstance(arg, (int, float)) or isinstance(arg, bool):
                ok = False
            elif key == "minimum":
                ok = value > arg if schema.get("exclusiveMinimum", False) else value >= arg
            else:
                ok = value < arg if schema.get("exclusiveMaximum", False) else value <= arg
        elif key in _BOUNDS:
            kind, most = _BOUNDS[key]
            ok = isinstance(arg, int) and (not isinstance(value, kind) or (len(value) <= arg if most else len(value) >= arg))
        elif key == "anyOf":
            ok = isinstance(arg, list) and any(_holds(value, sub, typed) for sub in arg)
        elif key == "allOf":
            ok = isinstance(arg, list) and all(_holds(value, sub, typed) for sub in arg)
        elif key == "format":  # structural: skipped; typed: integers within their Go type
            bounds = _INT_RANGE.get(arg) if isinstance(arg, str) else None
            ok = not typed or (isinstance(arg, str) and not (
                bounds and _is_integer(None, value) and not bounds[0] <= value <= bounds[1]))
        elif key == "x-kubernetes-list-type":
            ok = isinstance(arg, str) and (not isinstance(value, list) or not _duplicates(arg, value, schema))
        elif key == "x-kubernetes-validations":
            ok = not cel.check(arg, value, schema)
        else:  # not, oneOf, uniqueItems, multipleOf, ...: jsonschema's to judge
            ok = False
        if not ok:
            return False
    return True


def _finding(error: jsonschema.ValidationError, where: str) -> Finding:
    kw, inst, arg = error.validator, error.instance, error.validator_value
    if kw == "required":
        missing = re.match(r"'([^']*)' is a required property", error.message)
        return join(where, missing.group(1)) if missing else where, "Required value"
    if kw == "enum":
        allowed = ", ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in arg)
        return where, f"Unsupported value: {short(inst)}: supported values: {allowed}"
    if kw == "pattern":
        return where, f"Invalid value: {short(inst)}: should match '{arg}'"
    if kw in ("minimum", "maximum"):
        word = "greater" if kw == "minimum" else "less"
        exclusive = error.schema.get("exclusiveMinimum" if kw == "minimum" else "exclusiveMaximum")
        return where, f"Invalid value: {inst}: should be {word} than {'' if exclusive else 'or equal to '}{arg}"
    if kw in ("maxLength", "maxItems", "maxProperties"):
        unit = {"maxLength": "characters", "maxItems": "items", "maxProperties": "properties"}[kw]
        return where, f"Too long: may not be more than {arg} {unit}"
    if kw in ("minLength", "minItems", "minProperties"):
        unit = {"minLength": "characters", "minItems": "items", "minProperties": "properties"}[kw]
        return where, f"Invalid value: should have at least {arg} {unit}"
    if kw in ("anyOf", "oneOf"):
        return where, f"Invalid value: {short(inst)}: matches none of the allowed forms"
    return where, error.message


# --------------------------------------------------------------------------------------------
# The whole custom-resource check


def check_custom_resource(obj: dict, schema: dict, *, typed: bool = False,
                          values: bool = True) -> tuple[dict, list[tuple[str, str, str]]]:
    """(the object as the API server stores it: pruned and defaulted, (path, message, rule)s).

    Unknown fields are reported first and alone, as strict field validation does (the server
    answers 400 before validating values); otherwise the value rules of the defaulted object
    (not `values`: none, for a caller that validates the object a webhook then defaults).
    """
    pruned, unknown = prune(obj, schema)
    if unknown:
        return pruned, [(p, "unknown field" + _did_you_mean(p, schema), "schema") for p in unknown]
    apply_defaults(pruned, schema)
    return pruned, check_values(pruned, schema, typed=typed) if values else []


def check_values(stored: dict, schema: dict, *, typed: bool = False) -> list[tuple[str, str, str]]:
    """The value rules' (path, message, rule)s of an object pruned and defaulted already."""
    body = {k: v for k, v in stored.items() if k != "metadata"}
    meta = stored.get("metadata") if isinstance(stored.get("metadata"), dict) else {}
    # CEL rules at the root see metadata.name and metadata.generateName only.
    body["metadata"] = {k: meta[k] for k in ("name", "generateName") if k in meta}
    return validate_values(body, _without_metadata_schema(schema), typed=typed)


def _without_metadata_schema(schema: dict) -> dict:
    props = schema.get("properties") or {}
    if "metadata" not in props:
        return schema
    return {**schema, "properties": {k: v for k, v in props.items() if k != "metadata"}}


def _did_you_mean(path: str, schema: dict) -> str:
    import difflib

    node: dict | None = schema
    parts = re.findall(r"[^.\[\]]+|\[\d+\]", path)
    for part in parts[:-1]:
        if node is None:
            return ""
        node = node.get("items") if part.startswith("[") else (node.get("properties") or {}).get(part)
    candidates = list((node or {}).get("properties") or {})
    close = difflib.get_close_matches(parts[-1], candidates, n=1, cutoff=0.75) if parts else []
    return f", did you mean {close[0]!r}?" if close else ""


# --------------------------------------------------------------------------------------------
# CRDs


class CRDIndex:
    """CRD versions by (group, version, kind), read from CRD YAML files on first lookup.

    Files are parsed when a kind is first looked up, those that mention the kind first (the
    upstream CRDs are ~3 MB of YAML and one PyTorchJob needs one of them). Earlier files win.
    """

    def __init__(self, files: list[Path], source: str):
        self.source = source
        self._texts: dict[Path, str | None] = {f: None for f in files}
        self.versions: dict[tuple[str, str, str], dict] = {}
        self.objects: list[dict] = []  # non-CRD documents (runtimes next to their CRD, ...)

    def _parse(self, file: Path) -> None:
        text = self._text(file)
        self._texts.pop(file)
        for doc in _cached_documents(file, text):
            found = False
            for crd in _crds_in(doc):
                found = True
                spec = crd["spec"]
                group, kind = spec.get("group"), (spec.get("names") or {}).get("kind")
                for version in spec.get("versions") or []:
                    schema = (version.get("schema") or {}).get("openAPIV3Schema")
                    if schema:
                        self.versions.setdefault((group, version.get("name"), kind), {
                            "schema": schema, "scope": spec.get("scope", "Namespaced"),
                            "served": version.get("served", True)})
            if not found and isinstance(doc, dict):
                self.objects.append(doc)

    def _text(self, file: Path) -> str:
        if self._texts[file] is None:
            try:
                self._texts[file] = file.read_text()
            except OSError as exc:
                raise LintInputError(f"{file}: cannot read ({exc.strerror})") from None
        return self._texts[file]  # type: ignore[return-value]

    def lookup(self, api_version: str, kind: str) -> dict | None:
        """{'schema', 'scope', 'served'} of one kind and version, or None."""
        group, _, version = api_version.rpartition("/")
        key = (group, version, kind)
        mention = re.compile(rf"""kind["']?:\s*["']?{re.escape(kind)}\b""")
        for file in [f for f in self._texts if kind in self._text(f) and mention.search(self._text(f))]:
            if key in self.versions:
                break
            self._parse(file)
        return self.versions.get(key)

    def find_object(self, kind: str, name: str) -> dict | None:
        """A non-CRD object in the CRD folders (a ClusterTrainingRuntime beside its CRD)."""
        mention = re.compile(rf"""name["']?:\s*["']?{re.escape(name)}\b""")
        for file in [f for f in self._texts if name in self._text(f) and mention.search(self._text(f))]:
            self._parse(file)
        return next((o for o in self.objects if o.get("kind") == kind
                     and (o.get("metadata") or {}).get("name") == name), None)

    def _parse_all(self) -> None:
        for file in list(self._texts):
            self._text(file)
            self._parse(file)

    @property
    def kinds(self) -> list[str]:
        self._parse_all()
        return sorted({f"{k}.{g}/{v}" for g, v, k in self.versions})


def crd_files(directory: str | Path) -> list[Path]:
    root = Path(directory)
    if not root.is_dir():
        raise LintInputError(
            f"--crds {directory}: not a directory; pass a folder of CRD YAML "
            "(for example the output of `kubectl get crd pytorchjobs.kubeflow.org -o yaml`)"
        )
    return sorted(p for p in root.rglob("*") if p.suffix in (".yaml", ".yml", ".json"))


def load_crds(directory: str | Path | None = None, *, bundled: bool = True) -> CRDIndex:
    """The CRDs in `directory` (every `*.yaml`/`*.yml`/`*.json` below it), then the bundled ones.

    Non-CRD documents (a ClusterTrainingRuntime next to its CRD, say) are kept as objects.
    """
    files = crd_files(directory) if directory is not None else []
    if bundled:
        files += crd_files(BUNDLED_CRDS)
    return CRDIndex(files, str(directory) if directory is not None else "the bundled CRDs")


def _crds_in(doc: Any) -> Iterator[dict]:
    if not isinstance(doc, dict):
        return
    if doc.get("kind") == "List":  # `kubectl get crd -o yaml` with several names
        for item in doc.get("items") or []:
            yield from _crds_in(item)
    elif doc.get("kind") == "CustomResourceDefinition" and isinstance(doc.get("spec"), dict):
        yield doc


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ddpkit" / "lint-crds"


def _cached_documents(file: Path, text: str) -> list[Any]:
    """The documents of a CRD file, through a JSON cache keyed by the text's hash, their schemas
    without the `description`s below the root (two thirds of an upstream CRD's bytes, and no
    rule reads them: `_lean`).

    libyaml needs ~0.5 s for one upstream CRD (600-900 kB); json ~5 ms. The cache is an
    optimisation only: an unwritable or corrupt cache falls back to YAML.
    """
    import hashlib
    import json

    digest = hashlib.md5(text.encode(), usedforsecurity=False).hexdigest()  # a third of sha256's work
    cached = _cache_dir() / f"{digest}-lean.json"
    try:
        return json.loads(cached.read_text())
    except (OSError, ValueError):
        pass
    docs = [_lean(doc) for doc in _load_documents(file, text)]
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(docs, default=str))
        tmp.replace(cached)
    except OSError:
        pass
    return docs


def _lean(doc: Any) -> Any:
    """`doc` (in place) without the descriptions of its CRDs' schemas, but at their roots."""
    for crd in _crds_in(doc):
        versions = crd["spec"].get("versions")
        for version in versions if isinstance(versions, list) else []:
            schema = (version.get("schema") or {}).get("openAPIV3Schema") if isinstance(version, dict) else None
            if isinstance(schema, dict):
                _drop_descriptions(schema, root=True)
    return doc


def _drop_descriptions(schema: dict, root: bool = False) -> None:
    if not root:
        schema.pop("description", None)
    subschemas = [schema.get(k) for k in ("additionalProperties", "items", "not")]
    for key in ("properties", "patternProperties"):
        subschemas += schema[key].values() if isinstance(schema.get(key), dict) else []
    for key in ("allOf", "anyOf", "oneOf"):
        subschemas += schema[key] if isinstance(schema.get(key), list) else []
    for sub in subschemas:
        if isinstance(sub, dict):
            _drop_descriptions(sub)


def _load_documents(file: Path, text: str | None = None) -> list[Any]:
    try:
        if text is None:
            text = file.read_text()
        return load_documents(text)
    except OSError as exc:
        raise LintInputError(f"{file}: cannot read ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" (line {mark.line + 1})" if mark else ""
        raise LintInputError(f"{file}: not valid YAML{line}: {getattr(exc, 'problem', exc)}") from None
