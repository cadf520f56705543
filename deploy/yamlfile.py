"""Read one YAML job file defensively and remember the line of every key.

Guards: a size limit, strict UTF-8, one document, no duplicate keys, and a bound on the size of
the tree after YAML aliases are expanded (an "alias bomb" is a few lines that expand to billions
of nodes). Every failure is a `UserError` with one line that says what to fix.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from deploy.errors import UserError

MAX_FILE_BYTES = 1 << 20  # a job file is a page of YAML; 1 MiB is generous
MAX_EXPANDED_NODES = 100_000

Path_ = tuple  # a key path such as ("slurm", "partition") or ("volumes", 0, "mount")

_BASE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present
#: The safe dumper, libyaml's when present (several times faster than the pure-Python one).
Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
_SEXAGESIMAL = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")


class JobLoader(_BASE_LOADER):  # type: ignore[misc, valid-type]
    """Safe loading (libyaml's when present) without YAML 1.1's base-60 numbers: `nodes: 2:4`
    is the string "2:4" (an elastic range), not the integer 124; Kubernetes' YAML has no base-60
    numbers either."""

    yaml_implicit_resolvers = {
        first: ([("tag:yaml.org,2002:str", _SEXAGESIMAL)] if first in "-+0123456789" else []) + list(rules)
        for first, rules in _BASE_LOADER.yaml_implicit_resolvers.items()
    }


def load_documents(text: str) -> list:
    """Every non-empty document of a multi-document YAML text (manifests, CRDs)."""
    return [d for d in yaml.load_all(text, Loader=JobLoader) if d is not None]


def load_scalar(text: str) -> object:
    """One `--set` value, typed as in a job file."""
    return yaml.load(text, Loader=JobLoader)


def read_text(path: str | Path) -> str:
    """The text of a job file, or a UserError naming what is wrong with the file itself."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{path}: no such file; create one with `ddpkit init {path}`")
    if p.is_dir():
        raise UserError(f"{path}: is a directory; pass the job's YAML file")
    try:
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            raise UserError(
                f"{path}: file is {size / 2**20:.1f} MiB; a job file is at most 1 MiB "
                "(keep data out of it: mount a volume)"
            )
        raw = p.read_bytes()
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{path}: not UTF-8 text (bad byte at offset {exc.start}); save the file as UTF-8"
        ) from None


def _expanded_size(node: yaml.Node, memo: dict[int, int]) -> int:
    key = id(node)
    if key in memo:
        return memo[key]
    memo[key] = 1  # cycles count once
    total = 1
    if isinstance(node, yaml.SequenceNode):
        total += sum(_expanded_size(child, memo) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        total += sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    memo[key] = min(total, MAX_EXPANDED_NODES + 1)
    return memo[key]


def _index_lines(node: yaml.Node, path: Path_, lines: dict, dups: list[str]) -> None:
    """Record the 1-based line of every key path; collect duplicate keys."""
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is None:
                continue
            if key in seen:
                dotted = ".".join(str(p) for p in (*path, key))
                dups.append(f"{key_node.start_mark.line + 1}: {dotted}: duplicate key; "
                            "keep one")
            seen.add(key)
            lines[(*path, key)] = key_node.start_mark.line + 1
            _index_lines(value_node, (*path, key), lines, dups)
    elif isinstance(node, yaml.SequenceNode):
        for i, child in enumerate(node.value):
            _index_lines(child, (*path, i), lines, dups)


def load_yaml(text: str, source: str) -> tuple[object, dict]:
    """Parse one YAML document; return (data, {key path: line})."""
    loader = JobLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except yaml.composer.ComposerError as exc:
            if "single document" in str(exc):
                raise UserError(f"{source}: holds several YAML documents; a job file holds one")\
                    from None
            raise
        if node is None:
            raise UserError(f"{source}: the file is empty; start from `ddpkit init`")
        if _expanded_size(node, {}) > MAX_EXPANDED_NODES:
            raise UserError(
                f"{source}: YAML aliases expand to more than {MAX_EXPANDED_NODES} nodes; "
                "write the values out instead of nesting aliases"
            )
        lines: dict = {}
        dups: list[str] = []
        _index_lines(node, (), lines, dups)
        if dups:
            raise UserError(*(f"{source}:{d}" for d in dups))
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f":{mark.line + 1}" if mark else ""
        what = exc.problem or exc.context or "invalid YAML"
        if exc.problem and exc.context and exc.context_mark:
            what += f" ({exc.context} at line {exc.context_mark.line + 1})"
        raise UserError(f"{source}{where}: invalid YAML: {what}") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{source}: invalid YAML: {exc}") from None
    except RecursionError:
        raise UserError(f"{source}: YAML nested too deeply") from None
    finally:
        loader.dispose()
    return data, lines


class ManifestDumper(Dumper):  # type: ignore[misc, valid-type]
    """The safe dumper for manifests: multi-line strings as literal blocks (`|`), so a job file
    carried in a ConfigMap stays readable."""


#: Strings that Kubernetes' YAML (go-yaml v2, YAML 1.1) reads as booleans although PyYAML
#: writes them plain: quoted, or `kubectl apply` would see a bool where a string belongs.
_GO_YAML_BOOLS = {"y", "Y", "n", "N"}


def _str_presenter(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data else ("'" if data in _GO_YAML_BOOLS else None)
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


ManifestDumper.add_representer(str, _str_presenter)


def dump_documents(documents: list) -> str:
    """Multi-document YAML (`---` between documents), block style, keys in insertion order."""
    return yaml.dump_all(documents, Dumper=ManifestDumper, sort_keys=False,
                         default_flow_style=False, width=1000, explicit_start=False)


def locate(loc: tuple, source: str, lines: dict, overridden: set) -> str:
    """Where the field at `loc` was written: `--set KEY`, `FILE:LINE` of it or its nearest
    written parent, else just FILE."""
    for n in range(len(loc), -1, -1):
        prefix = loc[:n]
        if prefix in overridden:
            return f"--set {'.'.join(map(str, prefix))}"
        if prefix in lines:
            return f"{source}:{lines[prefix]}"
    return source
