"""Offline checks of Kubernetes manifests (`ddpkit lint FILE... [--crds DIR] [--strict]`).

An **error** is what a real API server (or an operator's admission webhook) would refuse; a
**warning** is what it accepts but ddpkit advises against, or what the controller will fail on
later (the pods a JobSet's Jobs create). Warnings do not change the exit code unless
`--strict`. The layers, in the API server's own order for a create:

- custom resources (`schema`): pruning (unknown fields, strict field validation), the CRD's
  defaults, the operator's mutating webhook (`admission`), the OpenAPI value rules and CEL
  rules (`cel`), then the operator's validating webhook (`admission`);
- core kinds (`core`): the upstream OpenAPI schema (strict), ObjectMeta, and the API server's
  validation of Job, Service, ConfigMap and pod specs;
- ddpkit's advice (`advice`), warnings only.

The upstream CRDs ddpkit targets are bundled (`deploy/lint/crds/`); `--crds DIR` adds a
cluster's own, which take precedence. Nothing here touches the network or a cluster.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

from deploy.kube import core
from deploy.kube.finding import Finding, LintInputError, join
from deploy.kube.meta import validate_object_meta
from deploy.lint import advice, schema
from deploy.lint.admission import WEBHOOKS
from deploy.lint.report import ERROR, WARNING, LintBug, LintFinding
from deploy.lint.schema import CRDIndex, load_crds

__all__ = ["ERROR", "WARNING", "LintFinding", "LintInputError", "CRDIndex", "load_crds", "lint_object",
           "lint_text", "lint_files", "refusals", "run_lint", "RULES", "REFUSED_LATER"]

#: Every rule name a LintFinding can carry, with what it checks.
RULES = {
    "schema": "the object matches its schema (CRD or core OpenAPI), unknown fields included",
    "meta": "ObjectMeta: name, namespace, labels, annotations as the API server validates them",
    "cel": "the CRD's x-kubernetes-validations (CEL) rules",
    "webhook": "the operator's validating admission webhook (training-operator, JobSet, Trainer)",
    "api": "the API server's own validation of a core kind (Job, Service, ConfigMap, pod spec)",
    **advice.RULES,
}

#: Warnings that are refusals all the same: the API server accepts the object, and then refuses
#: the pods (or Services) its controller makes from it. `refusals` counts them with the errors.
REFUSED_LATER = frozenset({"pod-template", "hostnames"})

#: What a rule raises when its input is not the shape it expects. Caught only where an error
#: already reported explains it (the object is malformed); anywhere else it is `LintBug`.
_MALFORMED = (AttributeError, TypeError, KeyError, ValueError, IndexError)
_RUNTIME_KINDS = ("ClusterTrainingRuntime", "TrainingRuntime")


class LintRun:
    """What one lint run knows beyond a single object: CRDs, the core schema version, runtimes."""

    def __init__(self, crds: CRDIndex, k8s_version: str | None = None, objects: Iterable[Any] = ()):
        self.crds = crds
        self.k8s_version = k8s_version
        self._version: str | None = None
        self.runtimes = {(o.get("kind"), (o.get("metadata") or {}).get("name")): o for o in objects
                         if isinstance(o, dict) and o.get("kind") in _RUNTIME_KINDS}

    @property
    def version(self) -> str:
        if self._version is None:
            self._version = core.resolve_version(self.k8s_version)
        return self._version

    def find_runtime(self, kind: str, name: str, namespace: str) -> dict | None:
        found = self.runtimes.get((kind, name)) or self.crds.find_object(kind, name)
        if found and kind == "TrainingRuntime" and ((found.get("metadata") or {}).get("namespace") or "default") != namespace:
            return None
        return found


def _context(crds: CRDIndex | LintRun | None, k8s_version: str | None) -> LintRun:
    if isinstance(crds, LintRun):
        return crds
    return LintRun(crds if crds is not None else load_crds(), k8s_version)


def lint_object(obj: Any, crds: CRDIndex | LintRun | None = None, *, source: str = "-", index: int = 0,
                k8s_version: str | None = None) -> list[LintFinding]:
    """Every problem with one object (errors first, then warnings)."""
    ctx = _context(crds, k8s_version)
    if (not isinstance(obj, dict) or not isinstance(obj.get("kind"), str)
            or not isinstance(obj.get("apiVersion"), str)):
        return [LintFinding(source, f"document {index + 1}", "", "not a Kubernetes object "
                        "(needs apiVersion and kind, both strings)")]
    label = _object_label(obj)
    problems: list[LintFinding] = []

    def add(found: Iterable[Finding], rule: str, severity: str = ERROR) -> None:
        problems.extend(LintFinding(source, label, p, msg, rule, severity) for p, msg in found)

    try:
        if core.is_core(obj["apiVersion"]):
            add(core.validate_core(obj, ctx.version), "api")
        else:
            _lint_custom(obj, ctx, add, problems)
    except _MALFORMED as exc:
        if not any(p.severity == ERROR for p in problems):  # nothing explains it but our code
            raise LintBug(f"{source}: {label}: a ddpkit lint rule crashed on an object no rule "
                          f"refused ({type(exc).__name__}: {exc})") from exc
    if not any(p.severity == ERROR and p.rule == "schema" for p in problems):
        # advice reads only a structure the schema layer vouched for: a crash here is a bug
        for rule, path, message in advice.advise(obj) + advice.advise_hostnames(obj):
            problems.append(LintFinding(source, label, path, message, rule, WARNING))
    return problems


def _lint_custom(obj: dict, ctx: LintRun, add, problems: list[LintFinding]) -> None:
    kind, api_version = obj["kind"], obj["apiVersion"]
    group = api_version.rpartition("/")[0]
    crd = ctx.crds.lookup(api_version, kind)
    if crd is None:
        add([("", f"no CRD for {kind} ({api_version}) in {ctx.crds.source}: the API server answers "
                  f"\"no matches for kind\"; pass --crds DIR holding `kubectl get crd <plural>.{group} -o yaml`")],
            "schema")
        return
    meta_errors = validate_object_meta(obj.get("metadata"))
    unknown_meta = [f for f in meta_errors if f[1] == "unknown field"]
    hook = WEBHOOKS.get((group, kind))
    # with a webhook, the values judged are those of the object it defaulted (below)
    pruned, found = schema.check_custom_resource(obj, crd["schema"], values=hook is None)
    unknown = [(p, msg) for p, msg, _ in found if msg.startswith("unknown field")]
    if unknown or unknown_meta:
        add(unknown_meta + unknown, "schema")  # strict field validation answers 400 here
        return
    crashed = None
    if hook is not None:
        try:
            hook.default(pruned)
        except _MALFORMED as exc:
            crashed = exc  # explained by the schema errors below, else a bug of ours
        pruned, _ = schema.prune(pruned, crd["schema"])
        schema.apply_defaults(pruned, crd["schema"])
        found = schema.check_values(pruned, crd["schema"], typed=True)
    add(meta_errors, "meta")
    for rule in ("schema", "cel", "webhook"):
        add([(p, msg) for p, msg, r in found if r == rule], rule)
    if found or meta_errors:
        return  # the API server stops before the validating webhooks
    if crashed is not None:
        raise crashed
    if hook is not None:  # on an object the schema accepted: a crash is ddpkit's (lint_object)
        add(hook.validate(pruned, ctx.find_runtime), "webhook")
        add(hook.warnings(pruned), "webhook", WARNING)
    # A TrainJob's runtime patches are partial pod specs merged into the runtime's: not judged alone.
    # The JobSet controller adds a volume per VolumeClaimPolicy template to its Jobs' pods.
    claims = [{"name": (t.get("metadata") or {}).get("name"), "persistentVolumeClaim": {"claimName": "-"}}
              for p in (pruned.get("spec") or {}).get("volumeClaimPolicies") or [] for t in p.get("templates") or []
              ] if kind == "JobSet" else []
    if any(p.severity == ERROR for p in problems):
        return  # refused already: the pods' problems can wait
    for path, template, _ in (advice.pod_templates(pruned) if kind != "TrainJob" else ()):
        add(((join(path, p) if p else path, f"{msg} (the controller's pods will be refused)")
             for p, msg in _template_findings(template, claims)), "pod-template", WARNING)


def _template_findings(template: dict, extra_volumes: list[dict]) -> list[Finding]:
    if extra_volumes:
        template = copy.deepcopy(template)
        spec = template.setdefault("spec", {})
        spec["volumes"] = (spec.get("volumes") or []) + extra_volumes
    return [(p.lstrip("."), msg) for p, msg in core.validate_pod_template(template, "")]


def _object_label(obj: dict) -> str:
    meta = obj.get("metadata")
    name = meta.get("name", "?") if isinstance(meta, dict) else "?"
    return f"{obj.get('kind')}/{name}"


def documents(text: str, source: str) -> list[Any]:
    """The objects of a YAML text (a `kind: List` contributes its items)."""
    docs = schema._load_documents(Path(source), text)
    out: list[Any] = []
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "List" and isinstance(doc.get("items"), list):
            out += doc["items"]
        else:
            out.append(doc)
    return out


def lint_text(text: str, crds: CRDIndex | LintRun | None = None, *, source: str = "-",
              k8s_version: str | None = None) -> list[LintFinding]:
    docs = documents(text, source)
    base = _context(crds, k8s_version)
    ctx = LintRun(base.crds, base.k8s_version, docs)  # this text's runtimes, beside the CRDs'
    ctx._version = base._version
    return _lint_docs(docs, ctx, source)


@cache
def _bundled() -> CRDIndex:
    """The bundled CRDs, read once per process (`ddpkit render` lints what it renders)."""
    return load_crds()


def refusals(objects: list[dict]) -> list[LintFinding]:
    """What a cluster with the bundled CRDs refuses of `objects` applied together: the errors,
    and the warnings of REFUSED_LATER. A crash of a rule is `LintBug`, never a finding."""
    ctx = LintRun(_bundled(), None, objects)
    return [p for p in _lint_docs(list(objects), ctx, "-")
            if p.severity == ERROR or p.rule in REFUSED_LATER]


def _lint_docs(docs: list[Any], ctx: LintRun, source: str) -> list[LintFinding]:
    problems: list[LintFinding] = []
    for i, doc in enumerate(docs):
        problems += lint_object(doc, ctx, source=source, index=i)
    try:
        across = advice.advise_file(docs)
    except _MALFORMED:
        across = []
    for i, rule, path, message in across:
        problems.append(LintFinding(source, _object_label(docs[i]), path, message, rule, WARNING))
    return problems


def lint_files(paths: Iterable[str], crd_dir: str | Path | None = None, *,
               k8s_version: str | None = None, stdin_text: str | None = None) -> list[LintFinding]:
    """Lint YAML files (`-` reads `stdin_text`). Raises LintInputError on unusable input."""
    texts = []
    for path in paths:
        if path == "-":
            texts.append((path, stdin_text or ""))
            continue
        try:
            texts.append((path, Path(path).read_text()))
        except OSError as exc:
            raise LintInputError(f"{path}: cannot read ({exc.strerror})") from None
        except UnicodeDecodeError:
            raise LintInputError(f"{path}: not UTF-8 text") from None
    parsed = [(path, documents(text, path)) for path, text in texts]
    ctx = LintRun(load_crds(crd_dir), k8s_version, [d for _, docs in parsed for d in docs])
    problems: list[LintFinding] = []
    for path, docs in parsed:
        problems += _lint_docs(docs, ctx, path)
    return problems


def run_lint(paths: list[str], crds_dir: str | None = None, *, k8s_version: str | None = None,
             strict: bool = False, out=None, err=None) -> int:
    """`ddpkit lint`: one line per problem; 0 clean or warnings only (1 with --strict),
    1 errors, 2 unusable input."""
    import sys

    out = out or sys.stdout
    err = err or sys.stderr
    stdin_text = sys.stdin.read() if "-" in paths else None
    try:
        found = lint_files(paths, crds_dir, k8s_version=k8s_version, stdin_text=stdin_text)
    except LintInputError as exc:
        print(f"error: {exc}", file=err)
        return 2
    for problem in found:
        print(problem, file=out)
    errors = sum(p.severity == ERROR for p in found)
    warnings = len(found) - errors
    if found:
        print(f"{errors} error(s), {warnings} warning(s) in {len(paths)} file(s)", file=err)
    return 1 if errors or (strict and warnings) else 0
