"""Renderers: pure functions from a JobSpec to text (no clock, randomness or host lookups).

Templates are files: `slurm/*.sh.j2` at the top of the repository, shipped inside the package
as `deploy/_templates/slurm` by a non-editable install (Kubernetes objects are built as data by
`deploy.k8s`, not from templates). Every value
that reaches bash goes through the `shquote` filter and every value that reaches YAML through
`yaml` (a JSON scalar is a YAML flow scalar, so it is always safely quoted) or `to_yaml`.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
from pathlib import Path

import yaml

from deploy.yamlfile import ManifestDumper

_PACKAGE_DIR = Path(__file__).resolve().parent.parent


def template_dir(kind: str) -> Path:
    """Directory of the `kind` templates (`k8s` or `slurm`): installed copy, else the repo's."""
    for candidate in (_PACKAGE_DIR / "_templates" / kind, _PACKAGE_DIR.parent / kind):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"ddpkit templates for {kind!r} are missing; reinstall ddpkit")


def shquote(value: object) -> str:
    """Quote one value for bash (numbers too: they may come from user input)."""
    return shlex.quote(str(value))


def yaml_scalar(value: object) -> str:
    """One value as an inline YAML scalar (JSON syntax: always quoted where it must be)."""
    return json.dumps(value, ensure_ascii=False)


def to_yaml(value: object, indent: int = 0) -> str:
    """A block of YAML from data, indented by `indent` spaces after the first line."""
    text = yaml.dump(value, Dumper=ManifestDumper, sort_keys=False, default_flow_style=False,
                     width=1000).rstrip("\n")
    return text.replace("\n", "\n" + " " * indent)


def _bytecode_cache():
    """Compiled templates cached per user (keyed by template source checksum, so an edited
    template is recompiled). Compiling costs more than the rest of a render; without a writable
    cache directory ddpkit just compiles every time."""
    if os.environ.get("DDPKIT_NO_TEMPLATE_CACHE"):
        return None
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    directory = base / "ddpkit" / "templates"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK):
            return None
    except OSError:
        return None
    import jinja2

    return jinja2.FileSystemBytecodeCache(str(directory))


@functools.cache
def environment(kind: str):
    import jinja2  # only the sbatch templates need it; `render k8s` never loads it

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir(kind))),
        bytecode_cache=_bytecode_cache(),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["shquote"] = shquote
    env.filters["yaml"] = yaml_scalar
    env.filters["to_yaml"] = to_yaml
    return env


def render_template(kind: str, name: str, **context: object) -> str:
    return environment(kind).get_template(name).render(**context)
