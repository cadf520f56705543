"""Core kinds (Job, Service, ConfigMap, ...): schema, then the API server's own validation.

Schema: the OpenAPI schemas of upstream Kubernetes bundled in `kubernetes-validate` (its
`-strict` variant: unknown fields are errors, as kubectl's default strict field validation),
read with `jsonschema` once per process and kind, every error reported (not only the first).
A fast pass (`_schema_holds`) first walks the object alone, reading only the definitions it
reaches: an object it shows to break no rule is not given to jsonschema (nor kubernetes-validate
imported, nor its 1.8 MB of definitions parsed whole).

Then the part of kube-apiserver's validation (k8s.io/kubernetes v1.34
`pkg/apis/core/validation/validation.go`, `pkg/apis/batch/validation/validation.go`) that
matters for training workloads, ported with its messages, applied after the API server's
defaults: pod specs (containers, names, images, env, volumes and mounts, ports, resources,
tolerations, restart policy, ports under host networking, DNS config), Job (restart policy,
completion mode, counts and their Indexed caps, the name of the
longest pod hostname), Service (name, ports, headless), ConfigMap (keys, size). The same pod
rules judge the pod templates inside custom resources, where they are warnings: the API server
accepts the custom resource, and refuses the pods (or Jobs) its controller makes from it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from decimal import Decimal
from functools import cache
from pathlib import Path
from typing import Any

from deploy import kube, units
from deploy.kube import meta as m
from deploy.kube.finding import Finding, LintInputError, join

CORE_GROUPS = {"", "v1", "apps", "batch", "policy", "rbac.authorization.k8s.io", "networking.k8s.io",
               "scheduling.k8s.io", "storage.k8s.io", "autoscaling", "coordination.k8s.io",
               "node.k8s.io", "discovery.k8s.io", "apiextensions.k8s.io", "certificates.k8s.io",
               "admissionregistration.k8s.io", "resource.k8s.io", "events.k8s.io",
               "flowcontrol.apiserver.k8s.io"}


def is_core(api_version: str) -> bool:
    return api_version.rpartition("/")[0] in CORE_GROUPS


# --------------------------------------------------------------------------------------------
# Schema (kubernetes-validate's bundled JSON schemas, read by jsonschema)


def _kv():
    try:
        from kubernetes_validate import utils
    except ImportError:
        raise LintInputError("checking core kinds needs kubernetes-validate: pip install 'ddpkit[k8s]'") from None
    return utils


def resolve_version(k8s_version: str | None) -> str:
    if not k8s_version and (newest := _newest_schemas()) is not None:
        return newest  # what the lines below answer, without importing kubernetes-validate
    utils = _kv()
    version = (k8s_version or utils.latest_version()).removeprefix("v")
    if not re.fullmatch(r"\d+\.\d+(\.\d+)?", version):
        raise LintInputError(f"--k8s-version {version}: expected a version such as 1.30")
    wanted = utils.major_minor(version)
    known = [v for v in utils.all_versions() if _mm(v) <= _mm(wanted)]
    if _mm(wanted) > _mm(utils.latest_version()) or not known:
        raise LintInputError(f"--k8s-version {version}: not supported by the installed "
                             f"kubernetes-validate (newest: {utils.latest_version()})")
    return known[-1]


def _mm(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


@cache
def _schemas_folder() -> Path | None:
    """kubernetes-validate's folder of schemas, found without importing the package (its import
    is jsonschema's, a third of a `ddpkit render k8s`); None when it is not installed."""
    spec = importlib.util.find_spec("kubernetes_validate")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "kubernetes-json-schema"
    return folder if folder.is_dir() else None


def _newest_schemas() -> str | None:
    """The newest version kubernetes-validate has schemas of (`1.37.0`), from the folders'
    names (`v1.37.0-local-strict`) as its `latest_version()` reads them; None when not plainly
    one (a version other than N.N[.N], two spellings of the newest): resolve_version asks it."""
    folder = _schemas_folder()
    if folder is None:
        return None
    versions = {m.group(1) for m in map(re.compile(r"v([^-]*)").match, os.listdir(folder)) if m}
    if not versions or not all(re.fullmatch(r"\d+\.\d+(\.\d+)?", v) for v in versions):
        return None

    def key(version: str) -> tuple[int, ...]:  # as packaging's Version orders them: 1.37 == 1.37.0
        parts = [int(p) for p in version.split(".")]
        while parts and parts[-1] == 0:
            parts.pop()
        return tuple(parts)

    newest = max(versions, key=key)
    return newest if [v for v in versions if key(v) == key(newest)] == [newest] else None


def _schema_name(kind: str, api_version: str) -> str:
    """The file of a kind's schema in a version's folder (`job-batch-v1.json`)."""
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    return f"{kind.lower()}-{group_version}.json"


@cache
def _validator(version: str, kind: str, api_version: str):
    from importlib import resources

    import jsonschema
    from referencing import Registry

    base = resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{version}-local-strict"
    try:
        schema = json.loads((base / _schema_name(kind, api_version)).read_text())
    except FileNotFoundError:
        return None
    registry = Registry().with_resource("file:///api/_definitions.json", _definitions(str(base)))
    return jsonschema.Draft202012Validator({**schema, "$id": "file:///api/object.json"}, registry=registry)


@cache
def _definitions(base: str):
    from referencing import Resource

    return Resource.from_contents(json.loads((Path(base) / "_definitions.json").read_text()))


def core_schema(obj: dict, version: str) -> list[Finding]:
    if _schema_holds(obj, version):
        return []  # what jsonschema would find too
    validator = _validator(version, obj["kind"], obj["apiVersion"])
    if validator is None:
        return [("", f"no schema for {obj['kind']} {obj['apiVersion']} in Kubernetes {version}")]
    found = []
    for error in validator.iter_errors(obj):
        path = ""
        for part in error.absolute_path:
            path = join(path, part)
        message = error.message
        extra = re.match(r"Additional properties are not allowed \('(.+)' (was|were) unexpected\)", message)
        if extra:
            found += [(join(path, name.strip("' ")), "unknown field") for name in extra.group(1).split(", ")]
            continue
        found.append((path, message))
    return sorted(set(found))


# The fast pass: most objects break no rule of their schema, and showing that needs neither
# jsonschema nor the 1.8 MB of kubernetes-validate's `_definitions.json` parsed whole.

#: JSON's values as Python has them; within these, IS_TYPE's tests are jsonschema's exactly
#: (Draft 2020-12's, and the CRDs' Draft 4 with kube-openapi's integers: deploy/lint/schema.py).
JSON_TYPES = (dict, list, str, bool, int, float, type(None))
IS_TYPE = {
    "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None, "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
}
#: The keywords jsonschema's Draft 2020-12 validator acts on (Draft202012Validator.VALIDATORS:
#: a test holds them equal); any other key of a schema is an annotation it skips.
DRAFT2020_KEYWORDS = frozenset({
    "$dynamicRef", "$ref", "additionalProperties", "allOf", "anyOf", "const", "contains",
    "dependentRequired", "dependentSchemas", "enum", "exclusiveMaximum", "exclusiveMinimum", "format",
    "if", "items", "maxItems", "maxLength", "maxProperties", "maximum", "minItems", "minLength",
    "minProperties", "minimum", "multipleOf", "not", "oneOf", "pattern", "patternProperties",
    "prefixItems", "properties", "propertyNames", "required", "type", "unevaluatedItems",
    "unevaluatedProperties", "uniqueItems"})


def same_in_enum(value: Any, allowed: Any) -> bool:
    """`value` is one of `allowed` as jsonschema compares them, for a string, a number, a boolean
    or null of the same type; False when unsure (a list or a mapping)."""
    return isinstance(allowed, list) and any(
        type(each) is type(value) and each == value for each in allowed
        if isinstance(each, (str, int, float, type(None))))


def type_names(types: Any) -> list[str] | None:
    """A schema's `type` (a name or a list of names) as a list; None when a name is unknown."""
    names = [types] if isinstance(types, str) else types
    return names if isinstance(names, list) and all(t in IS_TYPE for t in names) else None


def type_holds(types: Any, value: Any) -> bool:
    if isinstance(types, str):  # the common case, first
        test = IS_TYPE.get(types)
        return test is not None and test(value)
    names = type_names(types)
    return names is not None and any(IS_TYPE[t](value) for t in names)


class _Definitions:
    """The `$defs` of a version's `_definitions.json`, each decoded alone from the file's text
    when first needed (a ConfigMap needs one of its 862). A key `"NAME":` whose quotes are not
    escaped can only be a key of an object, and the definitions' names are no one's fields."""

    def __init__(self, path: Path):
        self.text = path.read_text()
        self.decoded: dict[str, Any] = {}

    def get(self, name: str) -> Any:
        if name not in self.decoded:
            key, found = json.dumps(name) + ":", None
            at = self.text.find(key)
            if at >= 0 and self.text.find(key, at + 1) < 0:  # one, else not sure
                start = at + len(key)
                while start < len(self.text) and self.text[start] in " \t\r\n":
                    start += 1
                try:
                    found = json.JSONDecoder().raw_decode(self.text, start)[0]
                except ValueError:
                    found = None
            self.decoded[name] = found
        return self.decoded[name]


@cache
def _kind_schema(version: str, kind: str, api_version: str) -> dict | None:
    folder = _schemas_folder()
    try:
        schema = json.loads((folder / f"v{version}-local-strict" / _schema_name(kind, api_version)).read_text())
    except (TypeError, OSError, ValueError):  # no folder, no file
        return None
    return {k: v for k, v in schema.items() if k != "$id"} if isinstance(schema, dict) else None


@cache
def _version_definitions(version: str) -> _Definitions | None:
    try:
        return _Definitions(_schemas_folder() / f"v{version}-local-strict" / "_definitions.json")
    except (TypeError, OSError):
        return None


def _schema_holds(obj: dict, version: str) -> bool:
    """True when the schema of the object's kind certainly has nothing against it: core_schema's
    jsonschema pass would find nothing. False is "not sure" (a keyword this does not judge, a
    reference it does not follow); jsonschema then judges, and words the errors. The schema's
    own `$id` is dropped as jsonschema's is replaced (`_validator`)."""
    schema = _kind_schema(version, obj["kind"], obj["apiVersion"])
    definitions = _version_definitions(version) if schema is not None else None
    return definitions is not None and _holds(obj, schema, definitions, False)


def _holds(value: Any, schema: Any, definitions: _Definitions, in_definitions: bool) -> bool:
    if not isinstance(schema, dict) or not isinstance(value, JSON_TYPES) or "$id" in schema:
        return False

    def holds(v: Any, sub: Any) -> bool:
        return _holds(v, sub, definitions, in_definitions)

    for key, arg in schema.items():
        if key not in DRAFT2020_KEYWORDS or key == "format":  # no format is asserted
            continue
        if key == "$ref":  # `/api/_definitions.json#/$defs/NAME` (`#/$defs/NAME` within that file)
            prefix = "#/$defs/" if in_definitions else "/api/_definitions.json#/$defs/"
            name = arg[len(prefix):] if isinstance(arg, str) and arg.startswith(prefix) else ""
            ok = bool(re.fullmatch(r"[\w.-]+", name)) and _holds(value, definitions.get(name), definitions, True)
        elif key == "type":
            ok = type_holds(arg, value)
        elif key == "properties":
            ok = isinstance(arg, dict) and (not isinstance(value, dict) or all(
                holds(value[k], sub) for k, sub in arg.items() if k in value))
        elif key == "additionalProperties":
            known = schema.get("properties", {})
            if not isinstance(value, dict):
                ok = True
            elif not isinstance(known, dict) or "patternProperties" in schema:
                ok = False
            elif isinstance(arg, dict):
                ok = all(holds(v, arg) for k, v in value.items() if k not in known)
            else:
                ok = bool(arg) or all(k in known for k in value)
        elif key == "items":
            ok = not isinstance(value, list) or ("prefixItems" not in schema and isinstance(arg, dict)
                                                 and all(holds(v, arg) for v in value))
        elif key == "required":
            ok = isinstance(arg, list) and (not isinstance(value, dict) or all(k in value for k in arg))
        elif key == "enum":
            ok = same_in_enum(value, arg)
        elif key == "oneOf":  # exactly one of them: judged when each is a `type` of known names
            bare = isinstance(arg, list) and all(
                isinstance(sub, dict) and {k for k in sub if k in DRAFT2020_KEYWORDS and k != "format"} == {"type"}
                and type_names(sub["type"]) is not None for sub in arg)
            ok = bare and sum(type_holds(sub["type"], value) for sub in arg) == 1
        else:  # anything else: jsonschema's to judge
            ok = False
        if not ok:
            return False
    return True


# --------------------------------------------------------------------------------------------
# Pod spec (ValidatePodTemplateSpec / ValidatePodSpec)

_STANDARD_RESOURCES = {"cpu", "memory", "ephemeral-storage", "storage"}
_VOLUME_SOURCES = {
    "hostPath", "emptyDir", "gcePersistentDisk", "awsElasticBlockStore", "gitRepo", "secret", "nfs",
    "iscsi", "glusterfs", "persistentVolumeClaim", "rbd", "flexVolume", "cinder", "cephfs", "flocker",
    "downwardAPI", "fc", "azureFile", "configMap", "vsphereVolume", "quobyte", "azureDisk",
    "photonPersistentDisk", "projected", "portworxVolume", "scaleIO", "storageos", "csi",
    "ephemeral", "image",
}
_ENV_SOURCES = ("fieldRef", "resourceFieldRef", "configMapKeyRef", "secretKeyRef", "fileKeyRef")


def _dicts(value: Any) -> list[dict]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _is_native(name: str) -> bool:
    return "/" not in name or name.startswith("kubernetes.io/") or ".kubernetes.io/" in name.split("/")[0] + "/"


def _overcommittable(name: str) -> bool:
    return _is_native(name) and not name.startswith("hugepages-")


#: IsStandardContainerResourceName (pkg/apis/core/helper): the names without a domain.
STANDARD_CONTAINER_RESOURCES = ("cpu", "memory", "ephemeral-storage")


def _is_extended(name: str) -> bool:
    """IsExtendedResourceName: not native, and `requests.<name>` is a qualified name."""
    return not _is_native(name) and not name.startswith("requests.") and not kube.is_qualified_name(f"requests.{name}")


def validate_container_resource_name(name: str, path: str) -> list[Finding]:
    """validateContainerResourceName (pkg/apis/core/validation/validation.go), its messages."""
    errors = kube.is_qualified_name(name)
    if errors:
        return [m.invalid(path, name, e) for e in errors]
    if "/" not in name:
        if name in STANDARD_CONTAINER_RESOURCES or name.startswith("hugepages-"):
            return []
        return [m.invalid(path, name, "must be a standard resource type or fully qualified"),
                m.invalid(path, name, "must be a standard resource for containers")]
    if not _is_native(name) and not _is_extended(name):
        return [m.invalid(path, name, "doesn't follow extended resource name standard")]
    return []


def validate_resources(res: Any, path: str) -> list[Finding]:
    """ValidateContainerResourceRequirements (names, quantities, requests <= limits, extended
    ones equal); the job model asks it of k8s.extra_resources too (deploy/spec.py)."""
    if not isinstance(res, dict):
        return []
    found: list[Finding] = []
    limits = res.get("limits") if isinstance(res.get("limits"), dict) else {}
    requests = res.get("requests") if isinstance(res.get("requests"), dict) else {}
    parsed: dict[str, dict[str, Decimal]] = {"limits": {}, "requests": {}}
    for part, values in (("limits", limits), ("requests", requests)):
        for name, value in values.items():
            q = units.quantity(value)
            sub = join(join(path, part), str(name))
            found += validate_container_resource_name(str(name), sub)
            if q is None:
                found.append(m.invalid(sub, value, "quantities must match the regular expression "
                                       "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"))
                continue
            parsed[part][name] = q
            if q < 0:
                found.append(m.invalid(sub, value, "must be greater than or equal to 0"))
            if not _overcommittable(str(name)) and not _is_native(str(name)) and q != q.to_integral_value():
                found.append(m.invalid(sub, value, "must be an integer"))
    for name, q in parsed["requests"].items():
        limit = parsed["limits"].get(name)
        sub = join(join(path, "requests"), str(name))
        if limit is not None and q > limit:
            found.append(m.invalid(sub, requests[name], f"must be less than or equal to {name} limit of {limits[name]}"))
        if not _overcommittable(str(name)) and "/" in str(name) and not _is_native(str(name)):
            if limit is None:
                found.append(m.forbidden(sub, "Limit must be set for non overcommitable resources"))
            elif q != limit:
                found.append(m.invalid(sub, requests[name], f"must be equal to {name} limit of {limits[name]}"))
    return found


def _validate_env(env: Any, path: str) -> list[Finding]:
    found: list[Finding] = []
    for i, var in enumerate(env if isinstance(env, list) else []):
        if not isinstance(var, dict):
            continue
        sub = join(path, i)
        name = var.get("name")
        if not name:
            found.append(m.required(join(sub, "name")))
        elif isinstance(name, str) and (not name.isprintable() or "=" in name or not name.isascii()):
            found.append(m.invalid(join(sub, "name"), name, "a valid environment variable name must "
                                   "consist only of printable ASCII characters other than '='"))
        source = var.get("valueFrom")
        if isinstance(source, dict):
            kinds = [k for k in _ENV_SOURCES if k in source]
            if var.get("value"):
                found.append(m.invalid(join(sub, "valueFrom"), "", "may not be specified when `value` is not empty"))
            if len(kinds) != 1:
                found.append(m.invalid(join(sub, "valueFrom"), "", "must specify one of: `fieldRef`, "
                                       "`resourceFieldRef`, `configMapKeyRef`, `secretKeyRef` or `fileKeyRef`"
                                       if not kinds else "may not have more than one field specified at a time"))
    return found


def _validate_container(ctr: dict, path: str, volumes: set[str]) -> list[Finding]:
    found: list[Finding] = []
    name = ctr.get("name")
    if not name:
        found.append(m.required(join(path, "name")))
    elif isinstance(name, str):
        found += [m.invalid(join(path, "name"), name, e) for e in kube.is_dns1123_label(name)]
    if not ctr.get("image"):
        found.append(m.required(join(path, "image")))
    policy = ctr.get("imagePullPolicy")
    if policy not in (None, "", "Always", "Never", "IfNotPresent"):
        found.append(m.not_supported(join(path, "imagePullPolicy"), policy, ["Always", "IfNotPresent", "Never"]))
    port_names: set[str] = set()
    for i, port in enumerate(_dicts(ctr.get("ports"))):
        sub = join(join(path, "ports"), i)
        pname = port.get("name")
        if isinstance(pname, str) and pname:
            if len(pname) > 15 or not kube.IANA_SVC_NAME.match(pname) or not re.search("[a-z]", pname) \
                    or "--" in pname or pname.startswith("-") or pname.endswith("-"):
                found.append(m.invalid(join(sub, "name"), pname, "must be an IANA_SVC_NAME (at most 15 "
                                       "characters, matching regex [a-z0-9]([a-z0-9-]*[a-z0-9])*, it must "
                                       "contain at least one letter [a-z], and hyphens cannot be adjacent to "
                                       "other hyphens)"))
            if pname in port_names:
                found.append(m.duplicate(join(sub, "name"), pname))
            port_names.add(pname)
        number = port.get("containerPort")
        if number is None or number == 0:
            found.append(m.required(join(sub, "containerPort")))
        elif isinstance(number, int) and not 1 <= number <= 65535:
            found.append(m.invalid(join(sub, "containerPort"), number, "must be between 1 and 65535, inclusive"))
        protocol = port.get("protocol", "TCP")
        if protocol not in ("TCP", "UDP", "SCTP"):
            found.append(m.not_supported(join(sub, "protocol"), protocol, ["SCTP", "TCP", "UDP"]))
    found += _validate_env(ctr.get("env"), join(path, "env"))
    paths: set[str] = set()
    for i, mount in enumerate(_dicts(ctr.get("volumeMounts"))):
        sub = join(join(path, "volumeMounts"), i)
        mname, mpath = mount.get("name"), mount.get("mountPath")
        if not mname:
            found.append(m.required(join(sub, "name")))
        elif mname not in volumes:
            found.append((join(sub, "name"), f"Not found: \"{mname}\""))
        if not mpath:
            found.append(m.required(join(sub, "mountPath")))
        elif mpath in paths:
            found.append(m.invalid(join(sub, "mountPath"), mpath, "must be unique"))
        paths.add(mpath)
    found += validate_resources(ctr.get("resources"), join(path, "resources"))
    return found


def validate_pod_spec(pod: Any, path: str) -> list[Finding]:
    """The rules of ValidatePodSpec that a training job's pod can break."""
    if not isinstance(pod, dict):
        return []
    found: list[Finding] = []
    volumes: set[str] = set()
    for i, vol in enumerate(_dicts(pod.get("volumes"))):
        sub = join(join(path, "volumes"), i)
        name = vol.get("name")
        if not name:
            found.append(m.required(join(sub, "name")))
        elif isinstance(name, str):
            found += [m.invalid(join(sub, "name"), name, e) for e in kube.is_dns1123_label(name)]
            if name in volumes:
                found.append(m.duplicate(join(sub, "name"), name))
            volumes.add(name)
        sources = [k for k in vol if k in _VOLUME_SOURCES]
        if not sources:
            found.append(m.required(sub, "must specify a volume type"))
        elif len(sources) > 1:
            found.append(m.forbidden(join(sub, sources[1]), "may not specify more than 1 volume type"))
    containers = pod.get("containers")
    if not containers:
        found.append(m.required(join(path, "containers")))
    names: set[str] = set()
    for field_name in ("initContainers", "containers"):
        for i, ctr in enumerate(_dicts(pod.get(field_name))):
            sub = join(join(path, field_name), i)
            found += _validate_container(ctr, sub, volumes)
            if isinstance(ctr.get("name"), str) and ctr.get("name"):
                if ctr["name"] in names:
                    found.append(m.duplicate(join(sub, "name"), ctr["name"]))
                names.add(ctr["name"])
    policy = pod.get("restartPolicy")
    if policy not in (None, "Always", "OnFailure", "Never"):
        found.append(m.not_supported(join(path, "restartPolicy"), policy, ["Always", "OnFailure", "Never"]))
    dns = pod.get("dnsPolicy")
    if dns not in (None, "ClusterFirstWithHostNet", "ClusterFirst", "Default", "None"):
        found.append(m.not_supported(join(path, "dnsPolicy"), dns,
                                     ["ClusterFirst", "ClusterFirstWithHostNet", "Default", "None"]))
    found += _validate_host_network_ports(pod, path)
    found += _validate_dns_config(pod, path)
    for key in ("hostname", "subdomain"):
        value = pod.get(key)
        if isinstance(value, str) and value:
            found += [m.invalid(join(path, key), value, e) for e in kube.is_dns1123_label(value)]
    found += m.validate_labels(pod.get("nodeSelector"), join(path, "nodeSelector"))
    for i, tol in enumerate(_dicts(pod.get("tolerations"))):
        found += validate_toleration(tol, join(join(path, "tolerations"), i))
    for key in ("terminationGracePeriodSeconds", "activeDeadlineSeconds"):
        value = pod.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value < (0 if key.startswith("term") else 1):
            found.append(m.invalid(join(path, key), value, "must be greater than or equal to 0"
                                   if key.startswith("term") else "must be between 1 and 2147483647, inclusive"))
    return found


def _validate_host_network_ports(pod: dict, path: str) -> list[Finding]:
    """validatePodHostNetworkDeps: under hostNetwork a (regular) container's hostPort, when set,
    must equal its containerPort (a Pod's unset hostPort is defaulted to containerPort first)."""
    if pod.get("hostNetwork") is not True:
        return []
    found: list[Finding] = []
    for i, ctr in enumerate(_dicts(pod.get("containers"))):
        for j, port in enumerate(_dicts(ctr.get("ports"))):
            host, container = port.get("hostPort") or 0, port.get("containerPort")
            if host != 0 and host != container:
                found.append(m.invalid(f"{path}.containers[{i}].ports[{j}].hostPort", host,
                                       "must match `containerPort` when `hostNetwork` is true"))
    return found


#: validation.go MaxDNSNameservers, MaxDNSSearchPaths, MaxDNSSearchListChars.
MAX_DNS_NAMESERVERS, MAX_DNS_SEARCH_PATHS, MAX_DNS_SEARCH_LIST_CHARS = 3, 32, 2048


def _validate_dns_config(pod: dict, path: str) -> list[Finding]:
    """validatePodDNSConfig: dnsPolicy None needs a dnsConfig with at least one nameserver; the
    counts and lengths of nameservers, searches and options (the IP and domain syntax of each
    entry is not checked here)."""
    config, sub = pod.get("dnsConfig"), join(path, "dnsConfig")
    if pod.get("dnsPolicy") == "None":
        if not isinstance(config, dict):
            return [m.required(sub, "must provide `dnsConfig` when `dnsPolicy` is None")]
        if not config.get("nameservers"):
            return [m.required(join(sub, "nameservers"),
                               "must provide at least one DNS nameserver when `dnsPolicy` is None")]
    if not isinstance(config, dict):
        return []
    found: list[Finding] = []
    servers = config.get("nameservers") if isinstance(config.get("nameservers"), list) else []
    searches = [str(s) for s in config.get("searches") or []] if isinstance(config.get("searches"), list) else []
    if len(servers) > MAX_DNS_NAMESERVERS:
        found.append(m.invalid(join(sub, "nameservers"), servers,
                               f"must not have more than {MAX_DNS_NAMESERVERS} nameservers"))
    if len(searches) > MAX_DNS_SEARCH_PATHS:
        found.append(m.invalid(join(sub, "searches"), searches,
                               f"must not have more than {MAX_DNS_SEARCH_PATHS} search paths"))
    if len(" ".join(searches)) > MAX_DNS_SEARCH_LIST_CHARS:
        found.append(m.invalid(join(sub, "searches"), searches, f"must not have more than "
                               f"{MAX_DNS_SEARCH_LIST_CHARS} characters (including spaces) in the search list"))
    for i, option in enumerate(_dicts(config.get("options"))):
        if not option.get("name"):
            found.append(m.required(f"{sub}.options[{i}]", "must not be empty"))
    return found


def validate_toleration(tol: dict, path: str) -> list[Finding]:
    """ValidateTolerations, for one toleration (the job model asks it too: deploy/spec.py)."""
    found: list[Finding] = []
    key, op, value, effect = tol.get("key") or "", tol.get("operator") or "", tol.get("value") or "", tol.get("effect") or ""
    if key:
        found += [m.invalid(join(path, "key"), key, e) for e in kube.is_qualified_name(str(key))]
    if not key and op != "Exists":
        found.append(m.invalid(join(path, "operator"), op, "operator must be Exists when `key` is empty, "
                               "which means \"match all values and all keys\""))
    if tol.get("tolerationSeconds") is not None and effect != "NoExecute":
        found.append(m.invalid(join(path, "effect"), effect, "effect must be 'NoExecute' when `tolerationSeconds` is set"))
    if op in ("Equal", ""):
        errs = kube.is_label_value(str(value))
        if errs:
            found.append(m.invalid(join(path, "operator"), value, ";".join(errs)))
    elif op == "Exists":
        if value:
            found.append(m.invalid(join(path, "operator"), value, "value must be empty when `operator` is 'Exists'"))
    else:
        found.append(m.not_supported(join(path, "operator"), op, ["Equal", "Exists"]))
    if effect and effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
        found.append(m.not_supported(join(path, "effect"), effect, ["NoExecute", "NoSchedule", "PreferNoSchedule"]))
    return found


def validate_pod_template(template: Any, path: str) -> list[Finding]:
    if not isinstance(template, dict):
        return []
    found = m.validate_object_meta(template.get("metadata"), path=join(path, "metadata"), top_level=False)
    return found + validate_pod_spec(template.get("spec"), join(path, "spec"))


# --------------------------------------------------------------------------------------------
# Kinds


def validate_job(job: dict) -> list[Finding]:
    """ValidateJob after the Job strategy's defaults (a generated selector, restartPolicy Always)."""
    spec = dict(job.get("spec")) if isinstance(job.get("spec"), dict) else {}
    if spec.get("completions") is None and spec.get("parallelism") is None:
        spec["completions"] = spec["parallelism"] = 1  # SetDefaults_Job
    name = (job.get("metadata") or {}).get("name") or ""
    found: list[Finding] = []
    for key in ("parallelism", "completions", "activeDeadlineSeconds", "backoffLimit",
                "ttlSecondsAfterFinished", "backoffLimitPerIndex", "maxFailedIndexes"):
        value = spec.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            found.append(m.invalid(join("spec", key), value, "must be greater than or equal to 0"))
    mode = spec.get("completionMode")
    if mode not in (None, "NonIndexed", "Indexed"):
        found.append(m.not_supported("spec.completionMode", mode, ["NonIndexed", "Indexed"]))
    if mode == "Indexed":
        found += _validate_indexed_counts(spec)
    else:
        for key in ("backoffLimitPerIndex", "maxFailedIndexes"):
            if spec.get(key) is not None:
                found.append(m.invalid(join("spec", key), spec[key], "requires indexed completion mode"))
    if spec.get("maxFailedIndexes") is not None and spec.get("backoffLimitPerIndex") is None:
        found.append(m.required("spec.backoffLimitPerIndex", "when maxFailedIndexes is specified"))
    # validatePodReplacementPolicy (kubernetes pkg/apis/batch/validation/validation.go)
    replacement = spec.get("podReplacementPolicy")
    if replacement is not None:
        if spec.get("podFailurePolicy") is not None:
            if replacement != "Failed":
                found.append(m.not_supported("spec.podReplacementPolicy", replacement, ["Failed"]))
        elif replacement not in ("Failed", "TerminatingOrFailed"):
            found.append(m.not_supported("spec.podReplacementPolicy", replacement,
                                         ["Failed", "TerminatingOrFailed"]))
    template = spec.get("template") if isinstance(spec.get("template"), dict) else {}
    found += validate_pod_template(template, "spec.template")
    # The strategy labels the pods with the job name (batch.kubernetes.io/job-name).
    if isinstance(name, str) and name and not spec.get("manualSelector"):
        found += [m.invalid("spec.template.metadata.labels", name, e) for e in kube.is_label_value(name)]
    if spec.get("selector") is not None and not spec.get("manualSelector"):
        found.append(m.invalid("spec.selector", spec["selector"], "`selector` not auto-generated"))
    pod = template.get("spec") if isinstance(template.get("spec"), dict) else {}
    policy = pod.get("restartPolicy") or "Always"
    if policy == "Always":
        found.append(m.required("spec.template.spec.restartPolicy", 'valid values: "OnFailure", "Never"'))
    elif policy not in ("OnFailure", "Never"):
        found.append(m.not_supported("spec.template.spec.restartPolicy", policy, ["OnFailure", "Never"]))
    elif spec.get("podFailurePolicy") is not None and policy != "Never":
        found.append(m.invalid("spec.template.spec.restartPolicy", policy,
                               'only "Never" is supported when podFailurePolicy is specified'))
    completions = spec.get("completions")
    if mode == "Indexed" and isinstance(completions, int) and completions > 0 and isinstance(name, str):
        hostname = f"{name}-{completions - 1}"
        if kube.is_dns1123_label(hostname):
            found.append(m.invalid("metadata.name", name,
                                   f"will not able to create pod with invalid DNS label: {hostname}"))
    return found


#: pkg/apis/batch/validation/validation.go (v1.34): maxParallelismForIndexedJob,
#: maxFailedIndexesForIndexedJob, completionsSoftLimit, parallelismLimitForHighCompletions,
#: maxFailedIndexesLimitForHighCompletions.
INDEXED_MAX_PARALLELISM = INDEXED_MAX_FAILED_INDEXES = COMPLETIONS_SOFT_LIMIT = 100_000
HIGH_COMPLETIONS_MAX_PARALLELISM = HIGH_COMPLETIONS_MAX_FAILED_INDEXES = 10_000


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _validate_indexed_counts(spec: dict) -> list[Finding]:
    """validateJobSpec's Indexed branch: completions required; parallelism and maxFailedIndexes
    capped (maxFailedIndexes also by completions); above 100000 completions with
    backoffLimitPerIndex, maxFailedIndexes is required and both caps drop to 10000."""
    found: list[Finding] = []
    completions, parallelism = _int(spec.get("completions")), _int(spec.get("parallelism"))
    max_failed = _int(spec.get("maxFailedIndexes"))
    if spec.get("completions") is None:
        found.append(m.required("spec.completions", "when completion mode is Indexed"))
    if parallelism is not None and parallelism > INDEXED_MAX_PARALLELISM:
        found.append(m.invalid("spec.parallelism", parallelism, "must be less than or equal to "
                               f"{INDEXED_MAX_PARALLELISM} when completion mode is Indexed"))
    if completions is not None and max_failed is not None and max_failed > completions:
        found.append(m.invalid("spec.maxFailedIndexes", max_failed, "must be less than or equal to completions"))
    if max_failed is not None and max_failed > INDEXED_MAX_FAILED_INDEXES:
        found.append(m.invalid("spec.maxFailedIndexes", max_failed,
                               f"must be less than or equal to {INDEXED_MAX_FAILED_INDEXES}"))
    if completions is not None and completions > COMPLETIONS_SOFT_LIMIT and spec.get("backoffLimitPerIndex") is not None:
        high = f"when completions are above {COMPLETIONS_SOFT_LIMIT} and used with backoff limit per index"
        if spec.get("maxFailedIndexes") is None:
            found.append(m.required("spec.maxFailedIndexes", f"must be specified when completions is above "
                                    f"{COMPLETIONS_SOFT_LIMIT}"))
        if parallelism is not None and parallelism > HIGH_COMPLETIONS_MAX_PARALLELISM:
            found.append(m.invalid("spec.parallelism", parallelism,
                                   f"must be less than or equal to {HIGH_COMPLETIONS_MAX_PARALLELISM} {high}"))
        if max_failed is not None and max_failed > HIGH_COMPLETIONS_MAX_FAILED_INDEXES:
            found.append(m.invalid("spec.maxFailedIndexes", max_failed,
                                   f"must be less than or equal to {HIGH_COMPLETIONS_MAX_FAILED_INDEXES} {high}"))
    return found


def validate_service(svc: dict) -> list[Finding]:
    spec = svc.get("spec") if isinstance(svc.get("spec"), dict) else {}
    found: list[Finding] = []
    svc_type = spec.get("type", "ClusterIP")
    headless = spec.get("clusterIP") == "None"
    ports = _dicts(spec.get("ports"))
    if not ports and svc_type != "ExternalName" and not headless:
        found.append(m.required("spec.ports"))
    names: set[str] = set()
    for i, port in enumerate(ports):
        sub = join("spec.ports", i)
        name = port.get("name")
        if len(ports) > 1 and not name:
            found.append(m.required(join(sub, "name")))
        elif isinstance(name, str) and name:
            found += [m.invalid(join(sub, "name"), name, e) for e in kube.is_dns1123_label(name)]
            if name in names:
                found.append(m.duplicate(join(sub, "name"), name))
            names.add(name)
        number = port.get("port")
        if not isinstance(number, int) or not 1 <= number <= 65535:
            found.append(m.invalid(join(sub, "port"), number, "must be between 1 and 65535, inclusive"))
    if headless and svc_type not in ("ClusterIP", None):
        found.append(m.invalid("spec.clusterIPs[0]", "None", f"may not be set to 'None' for {svc_type} services"))
    found += m.validate_labels(spec.get("selector"), "spec.selector")
    return found


_CONFIG_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


def _decoded_size(value: object) -> int:
    """A binaryData value counts as its bytes, not its base64 (ValidateConfigMap: len([]byte))."""
    import base64
    import binascii

    try:
        return len(base64.b64decode(str(value), validate=True))
    except (binascii.Error, ValueError):
        return len(str(value))


def validate_configmap(cm: dict) -> list[Finding]:
    found: list[Finding] = []
    size = 0
    keys: set[str] = set()
    for part in ("data", "binaryData"):
        values = cm.get(part) if isinstance(cm.get(part), dict) else {}
        for key, value in values.items():
            sub = join(part, str(key))
            if len(str(key)) > 253 or not _CONFIG_KEY.match(str(key)):
                found.append(m.invalid(part, key, "a valid config key must consist of alphanumeric "
                                       "characters, '-', '_' or '.' (e.g. 'key.name',  or 'KEY_NAME',  or "
                                       "'key-name', regex used for validation is '[-._a-zA-Z0-9]+')"))
            if key in keys:
                found.append(m.invalid(sub, key, "duplicate of key present in data"))
            keys.add(key)
            size += len(str(value)) if part == "data" else _decoded_size(value)
    if size > 1024 * 1024:
        found.append(("", "Too long: must have at most 1048576 bytes"))
    return found


#: Name rules per core kind (ValidateObjectMeta's nameFn); others: DNS-1123 subdomain.
NAME_RULES = {"Service": kube.is_dns1035_label, "Namespace": kube.is_dns1123_label}
KIND_RULES = {("batch", "Job"): validate_job, ("", "Service"): validate_service,
              ("", "ConfigMap"): validate_configmap}


def validate_core(obj: dict, version: str) -> list[Finding]:
    """Schema, ObjectMeta, then the kind's own rules (those ported) of one core object."""
    schema_errors = core_schema(obj, version)
    if schema_errors:
        return schema_errors  # strict decoding fails before validation runs
    found = m.validate_object_meta(obj.get("metadata"), NAME_RULES.get(obj["kind"], kube.is_dns1123_subdomain))
    rule = KIND_RULES.get((obj["apiVersion"].rpartition("/")[0], obj["kind"]))
    return found + (rule(obj) if rule else [])
