"""Offline checks of rendered Kubernetes objects (`ddpkit lint FILE... [--crds DIR]`).

Three layers, each reported as one line per problem (`FILE: Kind/name: path: message`):

1. Custom resources against their CRD's `openAPIV3Schema`, the way an API server with strict
   field validation reads them: unknown fields are errors, types, enums, patterns, bounds,
   required fields, list-map keys unique. The CRDs are an input (a directory of CRD YAML, for
   example `kubectl get crd pytorchjobs.kubeflow.org -o yaml`); a custom kind with no CRD in it
   is an error, never a silent pass. CEL rules (`x-kubernetes-validations`) are not evaluated;
   the few that matter for ddpkit (object names) are covered by the name rule below.
2. Core kinds with `kubernetes-validate --strict` (bundled OpenAPI schemas of upstream
   Kubernetes), and every pod template found inside a custom resource wrapped as a `PodTemplate`
   (kubernetes-validate passes unknown kinds silently, so this is what checks the pod specs
   inside a PyTorchJob or JobSet). kubernetes-validate is part of the `k8s` extra.
3. What no server checks but a training job needs (`RULES`): the `pytorch` container exists,
   Master replicas = 1, processes per node = GPU limit, GPU limits = requests, `/dev/shm`
   memory-backed, names valid, no env var the kit or the launcher owns set twice or by hand.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from deploy.k8s_names import (
    DNS1035_LABEL,
    DNS1123_LABEL,
    DNS1123_SUBDOMAIN,
    FLAVOR_KIND,
    LABEL_NAME,
    LABEL_VALUE,
    PYTORCHJOB_CONTAINER,
    TRAINJOB_NODE,
)
from deploy.yamlfile import load_documents

# --------------------------------------------------------------------------------------------
# Problems


@dataclass(frozen=True)
class Problem:
    """One finding: where (file, object, field path) and what."""

    source: str
    obj: str
    path: str
    message: str
    rule: str = "schema"

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        return f"{self.source}: {self.obj}: {where}{self.message}"


class LintInputError(Exception):
    """The input itself is unusable (unreadable file, bad YAML, a CRD directory that is not)."""


# --------------------------------------------------------------------------------------------
# Structural-schema validation (what kube-apiserver does for a CRD, minus CEL)

_INT_FORMATS = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def validate_schema(value: Any, schema: dict, path: str = "") -> list[tuple[str, str]]:
    """Check `value` against a structural OpenAPI v3 schema; return (path, message) pairs.

    Unknown fields (a key of an object schema that lists `properties`, has no
    `additionalProperties` and no `x-kubernetes-preserve-unknown-fields`) are errors: that is
    what `kubectl apply --validate=strict` (server-side field validation) reports, where a
    lenient server would drop them silently.
    """
    errors: list[tuple[str, str]] = []
    _validate(value, schema, path, errors)
    return errors


def _validate(value: Any, schema: dict, path: str, errors: list[tuple[str, str]]) -> None:
    if value is None:
        if schema.get("nullable"):
            return
        # The API server drops nulls for fields without `nullable` (and kubectl never sends
        # them); a rendered manifest should not contain one either.
        errors.append((path, "null value (omit the field instead)"))
        return

    int_or_string = schema.get("x-kubernetes-int-or-string") is True
    for sub in schema.get("allOf", []):
        _validate(value, sub, path, errors)
    if "anyOf" in schema and not int_or_string and not any(not _errors(value, s, path) for s in schema["anyOf"]):
        errors.append((path, f"{_short(value)} matches none of the allowed forms"))
    if "oneOf" in schema and sum(not _errors(value, s, path) for s in schema["oneOf"]) != 1:
        errors.append((path, f"{_short(value)} must match exactly one allowed form"))
    if "not" in schema and not _errors(value, schema["not"], path):
        errors.append((path, f"{_short(value)} is not allowed here"))

    actual = _type_name(value)
    expected = schema.get("type")
    if int_or_string:
        if actual not in ("integer", "string"):
            errors.append((path, f"expected an integer or a string, got {actual}"))
            return
    elif expected:
        ok = actual == expected or (expected == "number" and actual == "integer")
        if not ok:
            errors.append((path, f"expected {expected}, got {actual} {_short(value)}"))
            return

    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(repr(v) for v in schema["enum"])
        errors.append((path, f"{value!r} is not one of {allowed}"))

    if actual == "string":
        _check_string(value, schema, path, errors)
    elif actual in ("integer", "number"):
        _check_number(value, schema, path, errors)
    elif actual == "array":
        _check_array(value, schema, path, errors)
    elif actual == "object":
        _check_object(value, schema, path, errors)


def _errors(value: Any, schema: dict, path: str) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    _validate(value, schema, path, found)
    return found


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_string(value: str, schema: dict, path: str, errors: list) -> None:
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        errors.append((path, f"longer than {schema['maxLength']} characters"))
    if "minLength" in schema and len(value) < schema["minLength"]:
        errors.append((path, f"shorter than {schema['minLength']} characters"))
    if "pattern" in schema and not re.search(schema["pattern"], value):
        errors.append((path, f"{value!r} does not match {schema['pattern']}"))


def _check_number(value: float, schema: dict, path: str, errors: list) -> None:
    bounds = _INT_FORMATS.get(schema.get("format", ""))
    if bounds and not bounds[0] <= value <= bounds[1]:
        errors.append((path, f"{value} is out of range for {schema['format']}"))
    if "minimum" in schema:
        low = schema["minimum"]
        if value < low or (schema.get("exclusiveMinimum") is True and value == low):
            errors.append((path, f"{value} is below the minimum {low}"))
    if "maximum" in schema:
        high = schema["maximum"]
        if value > high or (schema.get("exclusiveMaximum") is True and value == high):
            errors.append((path, f"{value} is above the maximum {high}"))


def _check_array(value: list, schema: dict, path: str, errors: list) -> None:
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        errors.append((path, f"more than {schema['maxItems']} items"))
    if "minItems" in schema and len(value) < schema["minItems"]:
        errors.append((path, f"fewer than {schema['minItems']} items"))
    items = schema.get("items")
    if isinstance(items, dict):
        for i, item in enumerate(value):
            _validate(item, items, _join(path, i), errors)
    list_type = schema.get("x-kubernetes-list-type")
    if list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        seen: set = set()
        for i, item in enumerate(value):
            if isinstance(item, dict):
                key = tuple(repr(item.get(k)) for k in keys)
                if key in seen:
                    errors.append((_join(path, i), f"duplicate entry for key {', '.join(keys)}"))
                seen.add(key)
    elif list_type == "set" or schema.get("uniqueItems"):
        seen_values: list = []
        for i, item in enumerate(value):
            if item in seen_values:
                errors.append((_join(path, i), f"duplicate value {_short(item)}"))
            seen_values.append(item)


_EMBEDDED_FIELDS = {"apiVersion", "kind", "metadata"}


def _check_object(value: dict, schema: dict, path: str, errors: list) -> None:
    props = schema.get("properties", {})
    for name in schema.get("required", []):
        if name not in value:
            errors.append((_join(path, name), "required field is missing"))
    if "maxProperties" in schema and len(value) > schema["maxProperties"]:
        errors.append((path, f"more than {schema['maxProperties']} fields"))
    if "minProperties" in schema and len(value) < schema["minProperties"]:
        errors.append((path, f"fewer than {schema['minProperties']} fields"))
    extra = schema.get("additionalProperties")
    preserve = schema.get("x-kubernetes-preserve-unknown-fields") is True
    embedded = schema.get("x-kubernetes-embedded-resource") is True
    for key in value:
        sub = _join(path, key)
        if not isinstance(key, str):
            errors.append((sub, "object keys must be strings"))
        elif key in props:
            _validate(value[key], props[key], sub, errors)
        elif isinstance(extra, dict):
            _validate(value[key], extra, sub, errors)
        elif extra is True or preserve or (embedded and key in _EMBEDDED_FIELDS):
            continue
        elif extra is False or props or not _is_open_object(schema):
            hint = _did_you_mean(key, props)
            errors.append((sub, f"unknown field{hint}"))


def _is_open_object(schema: dict) -> bool:
    """An object schema with nothing to say about its fields (`type: object` alone).

    A structural schema prunes every field of such an object; kube-apiserver reports them as
    unknown under strict validation. A schema that does not constrain the type at all (for
    example the arms of an `anyOf`) says nothing, so it lets them through.
    """
    return schema.get("type") != "object"


def _did_you_mean(key: str, candidates: Iterable[str]) -> str:
    import difflib

    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.75)
    return f", did you mean {close[0]!r}?" if close else ""


# --------------------------------------------------------------------------------------------
# CRDs


class CRDIndex:
    """openAPIV3Schema by (group, version, kind), read from a directory of CRD YAML.

    Files are parsed when a kind is first looked up, those that mention the kind first: the
    upstream CRDs are ~3 MB of YAML and one PyTorchJob needs one of them (bench/lint_speed.py).
    """

    def __init__(self, files: list[Path], source: str):
        self.source = source
        self._texts = {f: None for f in files}
        self.schemas: dict[tuple[str, str, str], dict] = {}

    def _parse(self, file: Path) -> None:
        text = self._texts.pop(file)
        for doc in _load_documents(file, text):
            for crd in _crds_in(doc):
                group = crd["spec"]["group"]
                kind = crd["spec"]["names"]["kind"]
                for version in crd["spec"].get("versions", []):
                    schema = (version.get("schema") or {}).get("openAPIV3Schema")
                    if schema:
                        self.schemas[(group, version["name"], kind)] = schema

    def _text(self, file: Path) -> str:
        if self._texts[file] is None:
            try:
                self._texts[file] = file.read_text()
            except OSError as exc:
                raise LintInputError(f"{file}: cannot read ({exc.strerror})") from None
        return self._texts[file]

    def lookup(self, api_version: str, kind: str) -> dict | None:
        group, _, version = api_version.rpartition("/")
        key = (group, version, kind)
        mention = re.compile(rf"""\bkind["']?:\s*["']?{re.escape(kind)}\b""")
        for file in [f for f in self._texts if mention.search(self._text(f))]:
            if key in self.schemas:
                break
            self._parse(file)
        if key not in self.schemas:
            self._parse_all()
        return self.schemas.get(key)

    def _parse_all(self) -> None:
        for file in list(self._texts):
            self._text(file)
            self._parse(file)

    @property
    def kinds(self) -> list[str]:
        self._parse_all()
        return sorted({f"{k}.{g}/{v}" for g, v, k in self.schemas})


def load_crds(directory: str | Path) -> CRDIndex:
    """Index every `*.yaml`/`*.yml`/`*.json` under `directory`; CRDs in them are read on demand.

    Non-CRD documents (a ClusterTrainingRuntime next to its CRD, say) are ignored.
    """
    root = Path(directory)
    if not root.is_dir():
        raise LintInputError(
            f"--crds {directory}: not a directory; pass a folder of CRD YAML "
            "(for example the output of `kubectl get crd pytorchjobs.kubeflow.org -o yaml`)"
        )
    files = sorted(p for p in root.rglob("*") if p.suffix in (".yaml", ".yml", ".json"))
    return CRDIndex(files, str(directory))


def _crds_in(doc: Any) -> Iterator[dict]:
    if not isinstance(doc, dict):
        return
    if doc.get("kind") == "List":  # `kubectl get crd -o yaml` with several names
        for item in doc.get("items") or []:
            yield from _crds_in(item)
    elif doc.get("kind") == "CustomResourceDefinition" and isinstance(doc.get("spec"), dict):
        yield doc


def _load_documents(file: Path, text: str | None = None) -> list[Any]:
    try:
        if text is None:
            text = file.read_text()
        # libyaml's loader when present: the upstream CRDs are ~3 MB of YAML (2 s vs 0.3 s).
        return load_documents(text)
    except OSError as exc:
        raise LintInputError(f"{file}: cannot read ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" (line {mark.line + 1})" if mark else ""
        raise LintInputError(f"{file}: not valid YAML{line}: {getattr(exc, 'problem', exc)}") from None


# --------------------------------------------------------------------------------------------
# Core kinds (kubernetes-validate)

CORE_GROUPS = {"", "v1", "apps", "batch", "policy", "rbac.authorization.k8s.io", "networking.k8s.io",
               "scheduling.k8s.io", "storage.k8s.io", "autoscaling", "coordination.k8s.io",
               "node.k8s.io", "discovery.k8s.io", "apiextensions.k8s.io", "certificates.k8s.io",
               "admissionregistration.k8s.io", "resource.k8s.io", "events.k8s.io", "flowcontrol.apiserver.k8s.io"}


def _is_core(api_version: str) -> bool:
    group = api_version.rpartition("/")[0]
    return group in CORE_GROUPS


def core_validate(obj: dict, k8s_version: str | None = None) -> list[tuple[str, str]]:
    """Validate a core object with kubernetes-validate in strict mode (unknown fields fail)."""
    try:
        import kubernetes_validate
        from kubernetes_validate import utils as kv_utils
    except ImportError:
        raise LintInputError(
            "checking core kinds needs kubernetes-validate: pip install 'ddpkit[k8s]'"
        ) from None
    version = k8s_version or kv_utils.latest_version()
    if not re.fullmatch(r"v?\d+\.\d+(\.\d+)?", version):
        raise LintInputError(f"--k8s-version {version}: expected a version such as 1.30")
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ""
        for item in exc.path:
            path = _join(path, item)
        return [(path, exc.message)]
    except kubernetes_validate.SchemaNotFoundError:
        return [("", f"no schema for {obj.get('kind')} {obj.get('apiVersion')} in "
                     f"kubernetes-validate (Kubernetes {version})")]
    except (kv_utils.InvalidSchemaError, *_MALFORMED) as exc:  # kubernetes-validate on odd input
        return [("", f"could not be checked against the core schema: {exc}")]
    except kv_utils.VersionNotSupportedError:
        raise LintInputError(
            f"--k8s-version {version}: not supported by the installed kubernetes-validate "
            f"(newest: {kv_utils.latest_version()})"
        ) from None
    return []


def pod_templates_in(value: Any, path: str = "") -> Iterator[tuple[str, dict]]:
    """Every pod template inside an object: a `template` mapping whose `spec` has containers."""
    if isinstance(value, dict):
        for key, child in value.items():
            sub = _join(path, key)
            if (key == "template" and isinstance(child, dict)
                    and isinstance(child.get("spec"), dict) and "containers" in child["spec"]):
                yield sub, child
            else:
                yield from pod_templates_in(child, sub)
    elif isinstance(value, list):
        for i, child in enumerate(value):
            yield from pod_templates_in(child, _join(path, i))


def as_pod_template(template: dict, name: str = "lint") -> dict:
    """Wrap a pod template so kubernetes-validate checks it as a core `PodTemplate`."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
            "template": template}


# --------------------------------------------------------------------------------------------
# Rules no server checks


#: Env vars set by the launcher (torchrun), the operators or the Job controller; a container
#: that sets one by hand fights the launcher (pain point 11).
LAUNCHER_OWNED_ENV = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "JOB_COMPLETION_INDEX", "PET_NNODES", "PET_NODE_RANK",
    "PET_MASTER_ADDR", "PET_MASTER_PORT", "PET_NPROC_PER_NODE",
})
#: The kit's own variables (docs/CONTRACT.md); each must appear at most once.
KIT_ENV_PREFIX = "DDPKIT_"
TRAINING_KINDS = frozenset(FLAVOR_KIND.values())

RULES = {
    "pytorch-container": "every PyTorchJob replica has a container named `pytorch`",
    "replica-types": "PyTorchJob replica types are Master and Worker (the operator's webhook)",
    "images": "every container names an image",
    "master-replicas": "a PyTorchJob has exactly one Master replica (elastic jobs: none)",
    "nproc-gpus": "processes per node equal the GPU limit of the training container",
    "gpu-requests": "GPU requests equal GPU limits",
    "dev-shm": "/dev/shm is a memory-backed emptyDir mounted in the training container",
    "names": "object, container and label names are valid",
    "restart-policy": "PyTorchJob replicas restart OnFailure or Never (ExitCode ignores backoffLimit)",
    "job-subdomain": "an Indexed Job's subdomain is a headless Service in the file selecting its pods",
    "env-owned": "no env var owned by the kit or the launcher is set twice or overridden",
}


def _is_gpu_resource(name: str) -> bool:
    return "gpu" in name.lower()


def check_rules(obj: dict) -> list[tuple[str, str, str]]:
    """ddpkit's own checks of one object: (rule, path, message) triples."""
    found: list[tuple[str, str, str]] = []
    found += _check_names(obj)
    kind = obj.get("kind")
    spec = obj.get("spec") if isinstance(obj.get("spec"), dict) else {}
    if kind == "PyTorchJob":
        found += _check_pytorchjob(spec)
    if kind == "TrainJob":
        found += _check_trainjob(spec)
    elif kind in TRAINING_KINDS:
        for path, template in pod_templates_in(obj):
            pod = template.get("spec", {})
            nproc = _nproc(obj, pod)
            for i, container in enumerate(pod.get("containers") or []):
                cpath = f"{path}.spec.containers[{i}]"
                if not container.get("image"):
                    found.append(("images", f"{cpath}.image", "missing; name the trainer image"))
                found += _check_env(container.get("env") or [], f"{cpath}.env")
                found += _check_gpus(container.get("resources") or {}, nproc, f"{cpath}.resources")
            found += _check_shm(pod, _training_container(kind, pod), f"{path}.spec")
    return found


def _nproc(obj: dict, pod: dict) -> int | None:
    """Processes per node as the object states it (nprocPerNode or DDPKIT_NPROC_PER_NODE)."""
    spec = obj.get("spec") or {}
    for value in ((spec.get("elasticPolicy") or {}).get("nProcPerNode"), spec.get("nprocPerNode")):
        if value is not None and str(value).isdigit():
            return int(value)
    for container in pod.get("containers") or []:
        for env in container.get("env") or []:
            if env.get("name") == "DDPKIT_NPROC_PER_NODE" and str(env.get("value", "")).isdigit():
                return int(env["value"])
    return None


def _training_container(kind: str, pod: dict) -> dict | None:
    containers = pod.get("containers") or []
    if kind == "PyTorchJob":
        return next((c for c in containers if c.get("name") == PYTORCHJOB_CONTAINER), None)
    return containers[0] if containers else None


def _check_pytorchjob(spec: dict) -> list[tuple[str, str, str]]:
    found = []
    replicas = spec.get("pytorchReplicaSpecs") or {}
    master = replicas.get("Master")
    if master is None and "elasticPolicy" not in spec:
        found.append(("master-replicas", "spec.pytorchReplicaSpecs",
                      "no Master replica spec (the operator points PET_MASTER_ADDR at it)"))
    elif master is not None and master.get("replicas", 1) != 1:
        found.append(("master-replicas", "spec.pytorchReplicaSpecs.Master.replicas",
                      f"must be 1, got {master.get('replicas')}"))
    for role in replicas:
        if role not in ("Master", "Worker"):
            found.append(("replica-types", f"spec.pytorchReplicaSpecs.{role}",
                          f"{role!r} is not a replica type; use Master and Worker (case matters)"))
    for role, rspec in replicas.items():
        if (rspec or {}).get("restartPolicy") in ("ExitCode", "Always"):
            found.append(("restart-policy", f"spec.pytorchReplicaSpecs.{role}.restartPolicy",
                          f"{rspec['restartPolicy']} restarts pods without counting them against "
                          "runPolicy.backoffLimit (kubeflow/trainer#2045): a failing job loops "
                          "forever; use OnFailure"))
        containers = (((rspec or {}).get("template") or {}).get("spec") or {}).get("containers") or []
        if not any(c.get("name") == PYTORCHJOB_CONTAINER for c in containers):
            names = ", ".join(repr(c.get("name")) for c in containers) or "none"
            found.append(("pytorch-container", f"spec.pytorchReplicaSpecs.{role}.template.spec.containers",
                          f"no container named {PYTORCHJOB_CONTAINER!r} (found {names}); the operator only "
                          "configures a container with that name"))
    return found


def _check_trainjob(spec: dict) -> list[tuple[str, str, str]]:
    """TrainJob: the pod lives in the runtime; check what the TrainJob sets and patches."""
    found = []
    trainer = spec.get("trainer") or {}
    if not trainer.get("image"):
        found.append(("images", "spec.trainer.image", "missing; without it the runtime's "
                      "placeholder image runs instead of your trainer"))
    found += _check_env(trainer.get("env") or [], "spec.trainer.env")
    nproc = trainer.get("numProcPerNode")
    found += _check_gpus(trainer.get("resourcesPerNode") or {}, nproc if isinstance(nproc, int) else None,
                         "spec.trainer.resourcesPerNode")
    patched_pods = []
    for i, patch in enumerate(spec.get("runtimePatches") or []):
        rjobs = (((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}).get("replicatedJobs") or []
        for j, rjob in enumerate(rjobs):
            pod = (((rjob.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec")
            if isinstance(pod, dict):
                path = f"spec.runtimePatches[{i}].trainingRuntimeSpec.template.spec.replicatedJobs[{j}].template.spec.template.spec"
                patched_pods.append((path, pod))
                for k, container in enumerate(pod.get("containers") or []):
                    found += _check_env(container.get("env") or [], f"{path}.containers[{k}].env")
    if not any(_shm_ok(pod, (pod.get("containers") or [None])[0]) for _, pod in patched_pods):
        found.append(("dev-shm", "spec.runtimePatches",
                      "no memory-backed emptyDir mounted at /dev/shm in the trainer pod "
                      "(pods get 64 MiB otherwise; DataLoader workers die with 'Bus error')"))
    return found


def _check_env(env: list, path: str) -> list[tuple[str, str, str]]:
    found = []
    seen: set[str] = set()
    for i, var in enumerate(env):
        name = var.get("name") if isinstance(var, dict) else None
        if not isinstance(name, str):
            continue
        if name in seen and (name.startswith(KIT_ENV_PREFIX) or name in LAUNCHER_OWNED_ENV):
            found.append(("env-owned", f"{path}[{i}]",
                          f"{name} is set twice; the later value silently wins"))
        elif name in seen:
            found.append(("env-owned", f"{path}[{i}]", f"{name} is set twice"))
        if name in LAUNCHER_OWNED_ENV:
            found.append(("env-owned", f"{path}[{i}]",
                          f"{name} is set by the launcher/operator; remove it from env"))
        seen.add(name)
    return found


def _check_gpus(resources: dict, nproc: int | None, path: str) -> list[tuple[str, str, str]]:
    found = []
    limits = resources.get("limits") or {}
    requests = resources.get("requests") or {}
    for name in sorted(set(limits) | set(requests)):
        if not _is_gpu_resource(name):
            continue
        if name in requests and str(requests[name]) != str(limits.get(name)):
            found.append(("gpu-requests", f"{path}.requests.{name}",
                          f"{requests[name]} differs from the limit {limits.get(name)}"))
        if name in limits and nproc is not None and str(limits[name]) != str(nproc):
            found.append(("nproc-gpus", f"{path}.limits.{name}",
                          f"{limits[name]} GPUs but {nproc} processes per node; they must be equal"))
    return found


def _shm_ok(pod: dict, container: dict | None) -> bool:
    volumes = {v.get("name"): v for v in pod.get("volumes") or [] if isinstance(v, dict)}
    for mount in (container or {}).get("volumeMounts") or []:
        if mount.get("mountPath") == "/dev/shm":
            empty_dir = (volumes.get(mount.get("name")) or {}).get("emptyDir")
            return isinstance(empty_dir, dict) and empty_dir.get("medium") == "Memory"
    return False


def _check_shm(pod: dict, container: dict | None, path: str) -> list[tuple[str, str, str]]:
    if container is None or _shm_ok(pod, container):
        return []
    return [("dev-shm", path, f"container {container.get('name')!r} has no memory-backed emptyDir "
             "at /dev/shm (pods get 64 MiB; DataLoader workers die with 'Bus error')")]


def _check_names(obj: dict) -> list[tuple[str, str, str]]:
    found = []
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    name = meta.get("name")
    kind = obj.get("kind")
    if not isinstance(name, str) or not name:
        found.append(("names", "metadata.name", "missing"))
    elif kind in TRAINING_KINDS or kind == "Service":
        # Pod hostnames and Services are DNS-1035 labels: a job name must be one.
        if len(name) > 63 or not DNS1035_LABEL.match(name):
            found.append(("names", "metadata.name",
                          f"{name!r} is not a DNS-1035 label (lower case letters, digits, '-', "
                          "starting with a letter, at most 63 characters)"))
        longest = _longest_hostname(obj)
        if longest and len(longest) > 63:
            found.append(("names", "metadata.name",
                          f"pod hostname {longest!r} is {len(longest)} characters (at most 63: "
                          "longer ones are cut and peers cannot resolve them); shorten the name"))
    elif len(name) > 253 or not DNS1123_SUBDOMAIN.match(name):
        found.append(("names", "metadata.name", f"{name!r} is not a valid DNS-1123 subdomain"))
    found += _check_labels(meta, "metadata")
    for path, template in pod_templates_in(obj):
        found += _check_labels(template.get("metadata") or {}, f"{path}.metadata")
        for i, container in enumerate((template.get("spec") or {}).get("containers") or []):
            cname = container.get("name")
            if not isinstance(cname, str) or len(cname) > 63 or not DNS1123_LABEL.match(cname):
                found.append(("names", f"{path}.spec.containers[{i}].name",
                              f"{cname!r} is not a DNS-1123 label"))
    return found


def _longest_hostname(obj: dict) -> str | None:
    """The longest pod hostname the controller will give (each naming scheme per kind)."""
    name, spec = obj["metadata"]["name"], obj.get("spec") or {}
    try:
        if obj["kind"] == "PyTorchJob":
            return max((f"{name}-{role.lower()}-{max(int(r.get('replicas', 1)) - 1, 0)}"
                        for role, r in (spec.get("pytorchReplicaSpecs") or {}).items()), key=len, default=None)
        if obj["kind"] == "JobSet":
            return max((f"{name}-{r['name']}-{max(int(r.get('replicas', 1)) - 1, 0)}-"
                        f"{max(int(r['template']['spec'].get('parallelism', 1)) - 1, 0)}"
                        for r in spec.get("replicatedJobs") or []), key=len, default=None)
        if obj["kind"] == "Job" and spec.get("completionMode") == "Indexed":
            return f"{name}-{max(int(spec.get('completions', 1)) - 1, 0)}"
        if obj["kind"] == "TrainJob":
            return f"{name}-{TRAINJOB_NODE}-0-{max(int((spec.get('trainer') or {}).get('numNodes', 1)) - 1, 0)}"
    except (KeyError, TypeError, ValueError, AttributeError):
        return None  # malformed: the schema layer reports it
    return None


def check_file_rules(objects: list[dict]) -> list[tuple[int, str, str, str]]:
    """Rules across objects of one file: (object index, rule, path, message).

    `job-subdomain`: an Indexed Job whose pods name a subdomain needs a headless Service of that
    name in the same file that selects them (publishing not-ready addresses, so peers resolve
    before every pod is ready); without it `<name>-0.<subdomain>` never resolves.
    """
    found = []
    services = {(o.get("metadata") or {}).get("name"): o for o in objects
                if isinstance(o, dict) and o.get("kind") == "Service"}
    for i, obj in enumerate(objects):
        if not isinstance(obj, dict) or obj.get("kind") != "Job":
            continue
        template = ((obj.get("spec") or {}).get("template") or {})
        subdomain = (template.get("spec") or {}).get("subdomain")
        if not subdomain:
            continue
        path = "spec.template.spec.subdomain"
        svc = services.get(subdomain)
        if svc is None:
            found.append((i, "job-subdomain", path, f"no Service {subdomain!r} in this file; "
                          "pods are resolvable only through a headless Service of that name"))
            continue
        sspec = svc.get("spec") or {}
        labels = (template.get("metadata") or {}).get("labels") or {}
        selector = sspec.get("selector") or {}
        if sspec.get("clusterIP") != "None":
            found.append((i, "job-subdomain", path, f"Service {subdomain!r} is not headless "
                          "(clusterIP: None): pods get no DNS records"))
        if not selector or any(labels.get(k) != v for k, v in selector.items()):
            found.append((i, "job-subdomain", path, f"Service {subdomain!r} does not select "
                          "this Job's pods (its selector must match the pod template labels)"))
        if sspec.get("publishNotReadyAddresses") is not True:
            found.append((i, "job-subdomain", path, f"Service {subdomain!r} needs "
                          "publishNotReadyAddresses: true (workers resolve node 0 before it is ready)"))
    return found


def _check_labels(meta: dict, path: str) -> list[tuple[str, str, str]]:
    found = []
    for key, value in (meta.get("labels") or {}).items():
        prefix, _, name = str(key).rpartition("/")
        if (prefix and (len(prefix) > 253 or not DNS1123_SUBDOMAIN.match(prefix))) or len(name) > 63 \
                or not LABEL_NAME.match(name):
            found.append(("names", f"{path}.labels", f"{key!r} is not a valid label key"))
        if not isinstance(value, str) or len(value) > 63 or not LABEL_VALUE.match(value):
            found.append(("names", f"{path}.labels.{key}", f"{value!r} is not a valid label value"))
    return found


# --------------------------------------------------------------------------------------------
# Entry points

_OBJECT_META_FIELDS = {
    "name", "generateName", "namespace", "labels", "annotations", "finalizers", "ownerReferences",
    "uid", "resourceVersion", "generation", "creationTimestamp", "deletionTimestamp",
    "deletionGracePeriodSeconds", "managedFields", "selfLink",
}


def lint_object(obj: Any, crds: CRDIndex | None, *, source: str = "-", index: int = 0,
                k8s_version: str | None = None) -> list[Problem]:
    """Every problem with one object: schema (CRD or core), pod templates, ddpkit rules."""
    if (not isinstance(obj, dict) or not isinstance(obj.get("kind"), str)
            or not isinstance(obj.get("apiVersion"), str)):
        return [Problem(source, f"document {index + 1}", "", "not a Kubernetes object "
                        "(needs apiVersion and kind, both strings)")]
    kind, api_version = obj["kind"], obj["apiVersion"]
    label = _object_label(obj)
    problems: list[Problem] = []

    def add(found: Iterable[tuple[str, str]], prefix: str = "", rule: str = "schema") -> None:
        for path, message in found:
            full = f"{prefix}.{path}" if prefix and path else (prefix or path)
            problems.append(Problem(source, label, full, message, rule))

    if _is_core(api_version):
        add(core_validate(obj, k8s_version))
    else:
        schema = crds.lookup(api_version, kind) if crds else None
        if schema is None:
            where = f"in {crds.source}" if crds else "(no --crds directory given)"
            add([("", f"no CRD for {kind} ({api_version}) {where}; pass --crds DIR holding "
                      f"`kubectl get crd <plural>.{api_version.rpartition('/')[0]} -o yaml`")])
        else:
            # kube-apiserver checks metadata itself (ObjectMeta), not through the CRD schema.
            add(validate_schema({k: v for k, v in obj.items() if k != "metadata"}, schema))
            meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
            add((_join("metadata", k), "unknown field") for k in meta if k not in _OBJECT_META_FIELDS)
            for path, template in pod_templates_in(obj):
                found = core_validate(as_pod_template(template), k8s_version)
                add((_join(path, p.removeprefix("template.")) if p != "template" else path,
                     f"{m} (as a PodTemplate)") for p, m in found)
    try:
        found_rules = check_rules(obj)
    except _MALFORMED:
        # The rules read a structure the schema layer already rejected: its problems say why.
        found_rules = [] if problems else [("schema", "", "malformed object (a field has the "
                                                         "wrong type); check it against its schema")]
    for rule, path, message in found_rules:
        problems.append(Problem(source, label, path, message, rule))
    return problems


def _object_label(obj: dict) -> str:
    meta = obj.get("metadata")
    name = meta.get("name", "?") if isinstance(meta, dict) else "?"
    return f"{obj.get('kind')}/{name}"


_MALFORMED = (AttributeError, TypeError, KeyError, ValueError, IndexError)


def lint_text(text: str, crds: CRDIndex | None, *, source: str = "-",
              k8s_version: str | None = None) -> list[Problem]:
    problems: list[Problem] = []
    docs = _load_documents(Path(source), text)
    for i, doc in enumerate(docs):
        problems += lint_object(doc, crds, source=source, index=i, k8s_version=k8s_version)
    try:
        across = check_file_rules(docs)
    except _MALFORMED:
        across = []  # a malformed object: lint_object reported it
    for i, rule, path, message in across:
        problems.append(Problem(source, _object_label(docs[i]), path, message, rule))
    return problems


def lint_files(paths: Iterable[str], crd_dir: str | Path | None = None, *,
               k8s_version: str | None = None, stdin_text: str | None = None) -> list[Problem]:
    """Lint YAML files (`-` reads `stdin_text`). Raises LintInputError on unusable input."""
    crds = load_crds(crd_dir) if crd_dir else None
    problems: list[Problem] = []
    for path in paths:
        if path == "-":
            text = stdin_text or ""
        else:
            try:
                text = Path(path).read_text()
            except OSError as exc:
                raise LintInputError(f"{path}: cannot read ({exc.strerror})") from None
        problems += lint_text(text, crds, source=path, k8s_version=k8s_version)
    return problems


def run_lint(paths: list[str], crds_dir: str | None = None, *, k8s_version: str | None = None,
             out=None, err=None) -> int:
    """`ddpkit lint`: print one line per problem; 0 clean, 1 problems found, 2 unusable input."""
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
    if found:
        print(f"{len(found)} problem(s) in {len(paths)} file(s)", file=err)
        return 1
    return 0
