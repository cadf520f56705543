"""The job model: one typed description of a DDP job, validated once.

`deploy.load.load_job(path, overrides)` reads a YAML job file, applies `--set a.b=value`
overrides, and returns a `JobSpec` or raises `UserError` listing every problem at once, each as
`FILE:LINE: dotted.path: message`. Renderers and submitters trust a `JobSpec` and never
re-validate it.

Every field carries a description: the job-file reference (docs/reference.md) is generated from
them (`python -m deploy.docs`), and a test fails when the two drift apart.
"""

# No `from __future__ import annotations` in a module of pydantic models: pydantic would
# compile and evaluate each field's annotation from its text (`ddpkit render` reads them all).

import re
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PrivateAttr,
    field_validator,
    model_serializer,
    model_validator,
)

from deploy import units
from deploy.image_forms import IMAGE_PATTERN
from deploy.kube import (
    DNS1035_LABEL,
    DNS1123_LABEL,
    DNS1123_SUBDOMAIN,
    FLAVOR_KIND,
    JOB_FILE_DIR,
    KUEUE_QUEUE_LABEL,
    LABEL_VALUE,
    POD_VOLUMES,
    WORKDIR_MOUNT,
    WORKDIR_VOLUMES,
)
from deploy.kube import core as api_rules
from deploy.problems import Problem, Problems
from deploy.yamlfile import Dumper, locate
from trainer.config import (
    Args,
    CheckpointConfig,
    LocalRankArg,
    Module,
    Script,
    Steps,
    TorchrunArgs,
    TrainConfig,
    entry_problems,
)
from trainer.contract import DEFAULT_STOP_GRACE_S


def close_matches(word: str, choices, **kwargs) -> list[str]:
    """difflib's "did you mean", imported only when a job file has a typo (render speed)."""
    import difflib

    return difflib.get_close_matches(word, choices, **kwargs)


# --------------------------------------------------------------------------------------------
# Names and reserved variables

#: Longest job name. Targets append suffixes: PyTorchJob pods `<name>-worker-<i>`, TrainJob and
#: JobSet pods `<name>-node-0-<i>`, and Kubernetes caps hostnames and label values at 63
#: characters. 40 leaves room for 10,000 nodes and every suffix ddpkit renders.
MAX_NAME_LEN = 40

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
QUALIFIED_NAME = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
SLURM_WORD = re.compile(r"^[A-Za-z0-9_.,:@%+=/|&-]+$")  # partition, account, qos

#: One `--gres` item: NAME[:TYPE][:COUNT] (sbatch; a count may carry K, M, G or T).
GRES = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*(:(?![0-9]+(?::|$))[A-Za-z0-9][A-Za-z0-9_.-]*)?(:[1-9][0-9]*[KMGT]?)?")
_FEATURE = r"(?:[A-Za-z0-9_.:@%+=/-]+|\x00)(?:\*[1-9][0-9]*)?"  # \x00: a group already read
_EXPRESSION = re.compile(rf"{_FEATURE}(?:[&|]{_FEATURE})*")


def gres_problems(path: str, value: str) -> list[Problem]:
    """`--gres=` in slurm.extra_directives: resources beside the GPUs, which ddpkit asks for
    itself (and merges into one --gres with these: sbatch keeps only the last one given)."""
    for item in value.split(","):
        if item.split(":")[0] == "gpu":
            return [Problem(path, f"--gres={value}: ddpkit asks for the GPUs",
                            "set gpus_per_node (and slurm.gpu_type, slurm.gpu_flag); keep the rest here")]
        if not GRES.fullmatch(item):
            return [Problem(path, f"--gres={value}: {item!r} is not NAME[:TYPE][:COUNT]", "e.g. --gres=nvme:1")]
    return []


def constraint_ok(text: str) -> bool:
    """sbatch's --constraint grammar: features (each with an optional `*COUNT`) joined by `&`
    or `|`, `( )` groups, and at most one `[...]` set of them (matching OR, multiple counts)."""
    if text.count("[") > 1 or text.count("[") != text.count("]"):
        return False
    inner = text
    if "[" in text:
        head, _, rest = text.partition("[")
        body, _, tail = rest.partition("]")
        if not body or (head and not head.endswith(("&", "|"))) or (tail and not tail.startswith(("&", "|"))):
            return False
        inner = f"{head}({body}){tail}"
    return _groups_ok(inner)


def _groups_ok(text: str) -> bool:
    """Innermost `( )` group first, each features joined by & or | (with counts), then the rest."""
    while "(" in text:
        match = re.search(r"\(([^()]*)\)", text)
        if not match or not _EXPRESSION.fullmatch(match[1]):
            return False
        text = text[:match.start()] + "\x00" + text[match.end():]
    return bool(_EXPRESSION.fullmatch(text))


#: Kubernetes resource names of MIG slices (the NVIDIA device plugin's "mixed" strategy).
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"

#: Variables ddpkit or the launcher set for every process; a job file may not set them.
RESERVED_ENV = {
    "RANK": "torchrun sets the global rank of each process",
    "WORLD_SIZE": "torchrun derives it from nodes x processes per node",
    "LOCAL_RANK": "torchrun sets it per process",
    "LOCAL_WORLD_SIZE": "torchrun derives it from processes per node",
    "GROUP_RANK": "torchrun sets it per node",
    "NODE_RANK": "the launcher derives it from the scheduler",
    "MASTER_ADDR": "ddpkit derives it per target (pod 0's DNS name, first Slurm host)",
    "MASTER_PORT": "ddpkit derives it per target (23456 on Kubeflow, from the Slurm job id)",
    "JOB_COMPLETION_INDEX": "Kubernetes sets it on Indexed Jobs",
    "CUDA_VISIBLE_DEVICES": "the scheduler assigns GPUs; set gpus_per_node instead",
}
RESERVED_ENV_PREFIXES = {
    "PET_": "the Kubeflow operators set PET_* for torchrun",
    "TORCHELASTIC_": "torchrun sets TORCHELASTIC_*",
    "DDPKIT_": "ddpkit's launch contract uses DDPKIT_*",
    "SLURM_": "Slurm sets SLURM_*",
}


def reserved_env_reason(name: str) -> str | None:
    """Why `name` may not be set by a job file, or None when it may."""
    if name in RESERVED_ENV:
        return RESERVED_ENV[name]
    for prefix, reason in RESERVED_ENV_PREFIXES.items():
        if name.startswith(prefix):
            return reason
    return None


#: Kubernetes paths ddpkit mounts itself.
RESERVED_MOUNTS = {"/dev/shm": "set resources.shm instead", JOB_FILE_DIR: "ddpkit mounts the job file there"}

# --------------------------------------------------------------------------------------------
# Reusable field types


def _quantity(value: Any) -> str:
    units.parse_quantity(value)
    return str(value)


def _duration(value: Any) -> int:
    return units.parse_duration(value)


def _scalar_str(value: Any) -> Any:
    """Env values are strings exactly as written: YAML reads an unquoted `1.10` as 1.1, `0x10`
    as 16, `010` as 8 and `yes` as true, so anything but a string is refused."""
    if isinstance(value, bool) or value is None:
        raise ValueError("ambiguous YAML value (yes/no/true/null); quote it, e.g. \"true\"")
    if isinstance(value, (int, float)):
        raise ValueError(f"YAML read this as the number {value!r}, which may not be what you "
                         "wrote (1.10 reads as 1.1, 0x10 as 16, 010 as 8); quote it, e.g. "
                         f"\"{value}\"")
    return value


def _time_limit(value: Any) -> int:
    return units.parse_time_limit(value)


Quantity = Annotated[str, BeforeValidator(_quantity)]
Seconds = Annotated[int, BeforeValidator(_duration)]
#: time_limit: units or sbatch's HH:MM:SS forms, never a bare number (deploy/units.py
#: parse_time_limit); written back as a duration (`30m`), which reads the same.
TimeLimit = Annotated[int, BeforeValidator(_time_limit),
                      PlainSerializer(units.format_duration, return_type=str)]
EnvValue = Annotated[str, BeforeValidator(_scalar_str)]


def matching(pattern: re.Pattern | str, max_len: int, what: str) -> AfterValidator:
    """A string check: `pattern` must match the whole value, within `max_len` characters;
    else the user reads "'<value>' is not <what>"."""
    regex = re.compile(pattern)

    def check(value: str) -> str:
        if not regex.fullmatch(value) or len(value) > max_len:
            raise ValueError(f"{value!r} is not {what}")
        return value

    return AfterValidator(check)


K8sName = Annotated[str, matching(
    DNS1123_SUBDOMAIN, 253, "a valid Kubernetes name (lowercase letters, digits, '-', '.')")]
Namespace = Annotated[str, matching(
    DNS1123_LABEL, 63, "a valid namespace (lowercase letters, digits, '-')")]
SecretName = Annotated[str, matching(
    DNS1123_SUBDOMAIN, 253, "a valid Secret name (lowercase letters, digits, '-', '.')")]
SecretKey = Annotated[str, matching(
    r"[-._a-zA-Z0-9]+", 253, "a valid Secret key (letters, digits, '-', '_', '.')")]
VolumeName = Annotated[str, matching(
    DNS1123_LABEL, 63, "a valid volume name: lowercase letters, digits and '-', at most 63 characters")]
ImageRef = Annotated[str, matching(
    IMAGE_PATTERN, 512, "an image reference (e.g. registry.example/org/trainer:1.0), a docker:// URI, "
    "an enroot registry#image, or a .sif/.sqsh path")]
ResourceName = Annotated[str, matching(
    r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", 253,
    "an extended resource name such as nvidia.com/gpu")]
SlurmWord = Annotated[str, matching(
    SLURM_WORD, 256, "a Slurm name: letters, digits and _.,:@%+=/|&- only (no spaces)")]
ModuleName = Annotated[str, matching(r"[A-Za-z0-9_.+/-]+", 256, "a module name (e.g. cuda/12.4)")]


class Strict(BaseModel):
    """Base: unknown keys are errors; assignments re-validate.

    An empty list or mapping default is written `default=[]` / `default={}` (pydantic copies it
    for each instance), not `default_factory=list`: pydantic inspects a factory's signature, and
    a builtin's costs ~0.2 ms at import, twice per field (`ddpkit render`'s speed)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


# --------------------------------------------------------------------------------------------
# Sections


class Nodes(BaseModel):
    """Node count: a fixed `N`, or an elastic `MIN:MAX` range (PyTorchJob elasticPolicy)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min: int = Field(ge=1, le=10_000)
    max: int = Field(ge=1, le=10_000)

    @model_validator(mode="before")
    @classmethod
    def _parse(cls, value: Any) -> Any:
        if isinstance(value, (bool, float)) or value is None:
            raise ValueError(f"{value!r} is not a node count: write a whole number such as 2, "
                             "or an elastic range such as 2:4")
        if isinstance(value, int):
            value = {"min": value, "max": value}
        elif isinstance(value, str):
            match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", value)
            if not match:
                raise ValueError(f"{value!r} is not a node count: write 2, or 2:4 for elastic")
            low = int(match.group(1))
            value = {"min": low, "max": int(match.group(2) or low)}
        if isinstance(value, dict) and any(isinstance(v, int) and v < 1 for v in value.values()):
            raise ValueError("at least 1 node")
        return value

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.min > self.max:
            raise ValueError(f"elastic range {self.min}:{self.max} has min > max; write {self.max}:{self.min}")
        return self

    @model_serializer
    def _dump(self) -> int | str:
        return self.min if self.min == self.max else f"{self.min}:{self.max}"

    @property
    def elastic(self) -> bool:
        return self.min != self.max

    def __str__(self) -> str:
        return str(self._dump())


class Resources(Strict):
    """What each node asks the scheduler for, besides GPUs."""

    cpus_per_node: float | None = Field(
        None, gt=0, le=4096, description="CPU cores per node (Kubernetes requests/limits, "
        "Slurm `--cpus-per-task` x tasks). Empty: the scheduler's default."
    )
    memory: Quantity | None = Field(
        None, description="Memory per node as a Kubernetes quantity (`256Gi`); Slurm `--mem`. "
        "For all of a Slurm node's memory (`--mem=0`) set `slurm.all_memory` instead."
    )
    shm: Quantity = Field(
        "1Gi", description="Size of the memory-backed `/dev/shm` in every pod (DataLoader workers "
        "need more than the container default of 64 MiB). Counts against `memory`."
    )

    @property
    def memory_bytes(self) -> int | None:
        return None if self.memory is None else units.parse_quantity(self.memory)

    @property
    def shm_bytes(self) -> int:
        return units.parse_quantity(self.shm)

    @model_validator(mode="after")
    def _shm_fits(self) -> Self:
        if self.memory is not None and units.parse_quantity(self.memory) == 0:
            raise Problems([Problem("memory", "0 is no memory (Kubernetes would give the pod "
                                    "none)", "give an amount such as 32Gi; for all of a Slurm "
                                    "node's memory (--mem=0) set slurm.all_memory: true")])
        if self.memory is not None and self.shm_bytes > units.parse_quantity(self.memory):
            raise Problems([Problem("shm", f"{self.shm} exceeds memory ({self.memory}); /dev/shm "
                                    "counts against the memory limit", "lower shm or raise memory")])
        return self


class SecretEnv(Strict):
    """An environment variable whose value comes from a secret, never written into a file."""

    name: str = Field(description="Variable name inside the container.")
    secret: SecretName = Field(
        description="Kubernetes Secret name (on Slurm: the variable must already be set in the "
        "submitting environment).")
    key: SecretKey = Field(
        description="Key inside the Secret.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check_env_name(v)


class NFS(Strict):
    server: str = Field(description="NFS server host name or address.")
    path: str = Field(description="Exported path on the server.")


class EmptyDir(Strict):
    medium: Literal["", "Memory"] = Field("", description="`Memory` for tmpfs, empty for disk.")
    size_limit: Quantity | None = Field(None, description="Size limit as a quantity.")


#: `workdir.max_size` by default: the files a tree ships, before compression.
WORKDIR_MAX_SIZE = "100Mi"


class Workdir(Strict):
    """The directory shipped with the job, snapshotted at submit (deploy/workdir.py)."""

    dir: str = Field(description="The directory to ship, relative to the job file (`.`: the job "
                     "file's own). Snapshotted when the job is submitted (or run): every node, "
                     "every restart and requeue runs that snapshot as its working directory, "
                     "never the live tree; `script`/`module` and other relative paths are "
                     "read there. Writing `workdir: DIR` is short for `workdir: {dir: DIR}`.")
    exclude: list[str] = Field(
        default=[], description="What not to ship, in .gitignore syntax, relative to "
        "`dir` (`data/`, `*.ckpt`, `!keep.ckpt`). Applied after the tree's own .gitignore files "
        "(which always apply, as does leaving out `.git/` and ddpkit's own output directories, "
        "`slurm.log_dir` and `train.output_dir` as seen from where you submit), so they can "
        "re-include a file; as in git, nothing inside an excluded directory comes back.")
    max_size: Quantity = Field(
        WORKDIR_MAX_SIZE, description="The most the shipped files may hold together, before "
        "compression (`500Mi`, `2Gi`): a larger tree is refused with its largest files named, "
        "so that a data set or checkpoints left in it are not shipped by mistake.")
    image: str | None = Field(
        None, description="Kubernetes and `run --docker`: ship the tree as a thin image layer "
        "instead of a ConfigMap, for a tree over a ConfigMap's 1 MiB (as a tar.gz). The "
        "repository it is pushed to (`REGISTRY/team/train`, no tag): `ddpkit submit k8s` builds "
        "`<image>:workdir-<hash>` FROM the job's `image:` with the tree in `/workdir` (docker "
        "build: a Docker daemon on the submitting host) and pushes it where the cluster pulls "
        "from; on ddpkit's Kubernetes testbed it loads it into the nodes instead, as `kind load` "
        "would. The tag is the tree's content hash: an unchanged tree is not pushed again.")

    @model_validator(mode="before")
    @classmethod
    def _short_form(cls, value: Any) -> Any:
        return {"dir": value} if isinstance(value, str) else value

    @field_validator("dir")
    @classmethod
    def _dir(cls, v: str) -> str:
        if not v.strip() or any(c in v for c in "\n\r\0"):
            raise ValueError(f"{v!r} is not a directory path; give one such as `.` or `src`")
        return v

    @field_validator("exclude")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        problems = [Problem(str(i), f"{p!r} is not a pattern", "write one .gitignore pattern "
                            "per entry, e.g. data/") for i, p in enumerate(v)
                    if not p.strip() or any(c in p for c in "\n\r\0")]
        if problems:
            raise Problems(problems)
        return v

    @field_validator("image")
    @classmethod
    def _repository(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[a-z0-9][a-z0-9._-]*(:[0-9]+)?(/[a-z0-9][a-z0-9._-]*)*", v):
            raise ValueError(f"{v!r} is not an image repository; give one without a tag, in "
                             "lowercase, such as registry.example:5000/team/train")
        return v

    @field_validator("max_size")
    @classmethod
    def _positive(cls, v: str) -> str:
        if units.parse_quantity(v) <= 0:
            raise ValueError(f"{v} ships nothing; give a size such as {WORKDIR_MAX_SIZE}")
        return v

    @property
    def max_bytes(self) -> int:
        return units.parse_quantity(self.max_size)


VOLUME_SOURCES = ("claim", "host_path", "nfs", "empty_dir", "secret", "config_map")


class Volume(Strict):
    """A volume mounted into every node: exactly one of claim, host_path, nfs, empty_dir."""

    name: VolumeName = Field(
        description="Volume name (DNS-1123 label).")
    mount: str = Field(description="Absolute mount path inside the container.")
    read_only: bool = Field(False, description="Mount read-only.")
    claim: str | None = Field(None, description="PersistentVolumeClaim name.")
    host_path: str | None = Field(None, description="Absolute path on the node (also the "
                                  "Slurm/Docker source directory).")
    nfs: NFS | None = Field(None, description="NFS export: `{server, path}`.")
    empty_dir: EmptyDir | None = Field(None, description="Scratch space: `{medium, size_limit}`.")
    secret: K8sName | None = Field(None, description="Kubernetes Secret mounted as files "
                                   "(Kubernetes only; always read-only).")
    config_map: K8sName | None = Field(None, description="Kubernetes ConfigMap mounted as files "
                                       "(Kubernetes only; always read-only).")

    @field_validator("mount", "host_path")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("/") or "\n" in v or ":" in v):
            raise ValueError(f"{v!r} must be an absolute path without ':' (e.g. /data)")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        sources = [k for k in VOLUME_SOURCES if getattr(self, k) is not None]
        if len(sources) != 1:
            got = ", ".join(sources) or "none"
            raise ValueError(f"set exactly one of {', '.join(VOLUME_SOURCES)} (got {got})")
        reason = RESERVED_MOUNTS.get(self.mount.rstrip("/") or "/")
        if reason:
            raise ValueError(f"mount {self.mount} is reserved: {reason}")
        return self

    @property
    def source(self) -> str:
        return next(k for k in VOLUME_SOURCES if getattr(self, k) is not None)


class Toleration(Strict):
    key: str | None = Field(None, description="Taint key (empty with Exists: tolerate all).")
    operator: Literal["Exists", "Equal"] = Field("Equal", description="`Equal` or `Exists`.")
    value: str | None = Field(None, description="Taint value (with Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate; empty: all.")
    toleration_seconds: int | None = Field(None, ge=0, description="With NoExecute: how long.")

    def as_k8s(self) -> dict[str, Any]:
        """The pod spec's toleration (what deploy/k8s/pod.py renders)."""
        item = {"key": self.key, "operator": self.operator, "value": self.value, "effect": self.effect,
                "tolerationSeconds": self.toleration_seconds}
        return {k: v for k, v in item.items() if v is not None}

    @model_validator(mode="after")
    def _as_the_api_server_judges(self) -> Self:
        # kubernetes pkg/apis/core/validation/validation.go ValidateTolerations, as lint has it
        fields = {"key": "key", "operator": "operator", "effect": "effect"}
        found = api_rules.validate_toleration(self.as_k8s(), "")
        if found:
            raise Problems([Problem(fields[path], message) for path, message in found])
        return self


class Container(Strict):
    """An extra container of every pod (init container or sidecar)."""

    name: VolumeName = Field(description="Container name (DNS-1123 label).")
    image: ImageRef = Field(description="Its image.")
    command: list[str] = Field(default=[], description="Its argv (empty: the image's entrypoint).")
    args: list[str] = Field(default=[], description="Arguments after the command.")
    env: dict[str, EnvValue] = Field(default={}, description="Its environment (strings).")


class Spread(Strict):
    """One topologySpreadConstraint over the job's pods."""

    topology_key: str = Field(description="Node label to spread over, e.g. `topology.kubernetes.io/zone`.")
    max_skew: int = Field(1, ge=1, description="Largest allowed difference in pods between domains.")
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"] = Field(
        "DoNotSchedule", description="What the scheduler does when it cannot meet max_skew.")


class KueueTopology(Strict):
    """Kueue's topology-aware scheduling for the job's pods (docs/kubernetes.md "Topology")."""

    level: str = Field(description="The node label of the topology level the pods should share "
                       "(a rack or block label: `ddpkit.io/rack`, `cloud.google.com/gce-topology-block`): "
                       "a level of the Topology that the queue's ResourceFlavor names.")
    required: bool = Field(True, description="`true`: every pod in one domain of that level, or the "
                           "job waits (`podset-required-topology`); `false`: in as few domains as fit, "
                           "going a level up when one is too small (`podset-preferred-topology`).")

    @field_validator("level")
    @classmethod
    def _level(cls, v: str) -> str:
        if not QUALIFIED_NAME.match(v) or len(v.rsplit("/", 1)[-1]) > 63:
            raise ValueError(f"{v!r} is not a node label key (prefix/name, name at most 63 chars)")
        return v


#: Kubernetes 1.34 PodSpec fields (k8s.io/api core/v1 types.go), the keys `k8s.pod_patch.spec` may use.
POD_SPEC_FIELDS = (
    "activeDeadlineSeconds", "affinity", "automountServiceAccountToken", "containers",
    "dnsConfig", "dnsPolicy", "enableServiceLinks", "ephemeralContainers", "hostAliases",
    "hostIPC", "hostNetwork", "hostPID", "hostUsers", "hostname", "hostnameOverride",
    "imagePullSecrets", "initContainers", "nodeName", "nodeSelector", "os", "overhead",
    "preemptionPolicy", "priority", "priorityClassName", "readinessGates", "resourceClaims",
    "resources", "restartPolicy", "runtimeClassName", "schedulerName", "schedulingGates",
    "securityContext", "serviceAccount", "serviceAccountName", "setHostnameAsFQDN",
    "shareProcessNamespace", "subdomain", "terminationGracePeriodSeconds", "tolerations",
    "topologySpreadConstraints", "volumes")
#: What ddpkit sets itself, and the field that sets it.
POD_SPEC_OWNED = {"restartPolicy": "restarts", "subdomain": "k8s.flavor", "hostname": "k8s.flavor",
                  "activeDeadlineSeconds": "time_limit"}


def pod_patch_problems(patch: Any) -> list[Problem]:
    """`k8s.pod_patch`: a pod template fragment (metadata.labels/annotations, spec fields)."""
    if not isinstance(patch, dict):
        return [Problem("", "must be a mapping with `metadata` and/or `spec`")]
    problems = []
    for key in patch:
        if key not in ("metadata", "spec"):
            problems.append(Problem(str(key), "a pod template has only metadata and spec",
                                    "put pod fields under spec:"))
    meta = patch.get("metadata")
    if meta is not None:
        if not isinstance(meta, dict):
            problems.append(Problem("metadata", "must be a mapping"))
        else:
            for key in meta:
                if key not in ("labels", "annotations"):
                    problems.append(Problem(f"metadata.{key}", "only labels and annotations of a pod "
                                            "template can be patched"))
    spec = patch.get("spec")
    if spec is not None:
        if not isinstance(spec, dict):
            problems.append(Problem("spec", "must be a mapping of PodSpec fields"))
        else:
            for key in spec:
                if key not in POD_SPEC_FIELDS:
                    close = close_matches(str(key), POD_SPEC_FIELDS, n=1)
                    problems.append(Problem(f"spec.{key}", "not a PodSpec field",
                                            f"did you mean '{close[0]}'?" if close else
                                            "see `kubectl explain pod.spec`"))
                elif key in POD_SPEC_OWNED:
                    problems.append(Problem(f"spec.{key}", "ddpkit sets it",
                                            f"set {POD_SPEC_OWNED[key]} instead"))
            for i, c in enumerate(spec.get("containers") or []):
                if not isinstance(c, dict) or not c.get("name"):
                    problems.append(Problem(f"spec.containers.{i}", "each container patch names its "
                                            "container (`name: trainer` is the training container)"))
    return problems


class K8sSection(Strict):
    """Kubernetes-only settings."""

    flavor: Literal[tuple(FLAVOR_KIND)] = Field(  # type: ignore[valid-type]
        "pytorchjob", description="What to render: Kubeflow `pytorchjob` (v1), Trainer v2 "
        "`trainjob`, `jobset`, or `job` (Indexed Job + headless Service, no operator needed)."
    )
    namespace: Namespace = Field(
        "default", description="Namespace of every object.")
    labels: dict[str, str] = Field(default={}, description="Extra labels on every object and pod.")
    annotations: dict[str, str] = Field(default={}, description="Extra annotations on every pod.")
    node_selector: dict[str, str] = Field(default={}, description="Pod nodeSelector.")
    tolerations: list[Toleration] = Field(default=[], description="Pod tolerations.")
    node_lost_after: Seconds | None = Field(
        60, description="How long a pod stays bound to a node that stopped answering (taints "
        "`node.kubernetes.io/unreachable` and `not-ready`, NoExecute) before Kubernetes evicts it: "
        "the tolerations' tolerationSeconds (the API server's default is 300 s). `null`: the "
        "cluster's default. A pod on a dead node is only replaced once its node is deleted or "
        "tainted `node.kubernetes.io/out-of-service` (docs/kubernetes.md \"A node dies\").")
    priority_class: K8sName | None = Field(None, description="Pod priorityClassName.")
    service_account: K8sName | None = Field(None, description="Pod serviceAccountName.")
    image_pull_secrets: list[K8sName] = Field(default=[], description="Secret names for pulling the image.")
    queue: K8sName | None = Field(
        None, description="Kueue LocalQueue (`kueue.x-k8s.io/queue-name` label on the workload "
        "object): Kueue admits the job whole when its quota has room, else `ddpkit status` says "
        "QUEUED with Kueue's reason; every flavor (docs/kubernetes.md \"Kueue\").")
    topology: KueueTopology | None = Field(
        None, description="Kueue topology-aware scheduling (needs `k8s.queue`): the pods share one "
        "domain of a node label (a rack, a block), placed in node-rank order, so that ranks next to "
        "each other sit close; docs/kubernetes.md \"Topology\".")
    scheduler_name: K8sName | None = Field(None, description="Pod schedulerName (e.g. `volcano`).")
    gang: bool = Field(False, description="Gang-schedule all nodes (PyTorchJob schedulingPolicy.minAvailable).")
    ttl_after_finished: Seconds | None = Field(None, description="Delete the finished job after this duration (`1h`).")
    clean_pod_policy: Literal["None", "Running", "All"] = Field(
        "None", description="PyTorchJob runPolicy.cleanPodPolicy.")
    runtime: K8sName = Field("torch-distributed", description="TrainJob ClusterTrainingRuntime name.")
    termination_grace: Seconds = Field(
        DEFAULT_STOP_GRACE_S, description="Pod terminationGracePeriodSeconds: time for the SIGTERM checkpoint. With "
        "a time_limit the job is stopped this long before the limit, so the checkpoint is written by then.")
    extra_resources: dict[str, Quantity] = Field(
        default={}, description="More resources per node, requests = limits: "
        "`{rdma/ib: \"1\", hugepages-2Mi: 1Gi, ephemeral-storage: 100Gi}`.")
    capabilities: list[str] = Field(
        default=[], description="Linux capabilities added to the training container "
        "(e.g. `IPC_LOCK` for RDMA).")
    fs_group: int | None = Field(None, ge=0, description="Pod securityContext.fsGroup: volumes "
                                 "(a PVC) become writable by this group (the image runs as uid/gid 1000).")
    run_as_user: int | None = Field(None, ge=0, description="Pod securityContext.runAsUser.")
    run_as_group: int | None = Field(None, ge=0, description="Pod securityContext.runAsGroup.")
    host_network: bool = Field(False, description="Pods use the node's network (hostNetwork, "
                               "dnsPolicy ClusterFirstWithHostNet).")
    one_pod_per_node: bool = Field(False, description="Never two pods of the job on one node "
                                   "(required podAntiAffinity on kubernetes.io/hostname).")
    avoid_lost_nodes: bool = Field(True, description="A node lost under the job (NotReady while "
                                   "it held a pod) gets no pod of the job again: a required node "
                                   "affinity on the label `avoid.ddpkit.io/<name>`, which `ddpkit status "
                                   "--watch` puts on such a node (docs/kubernetes.md \"A node dies\").")
    topology_spread: list[Spread] = Field(default=[], description="Spread the pods "
                                          "over node topology domains (topologySpreadConstraints).")
    init_containers: list[Container] = Field(default=[], description="Containers run "
                                             "to completion before the trainer (they mount the job's volumes).")
    sidecars: list[Container] = Field(default=[], description="Containers running beside "
                                      "the trainer for the pod's life (native sidecars: Kubernetes 1.29+).")
    job_annotations: dict[str, str] = Field(default={}, description="Annotations on "
                                            "the workload object (PyTorchJob, TrainJob, JobSet, Job).")
    pod_patch: dict[str, Any] = Field(
        default={}, description="Anything else, merged into every pod template last, "
        "strategic-merge style: mappings merge, `null` removes a key, lists of named things "
        "(containers, initContainers, volumes, env, volumeMounts, ports, imagePullSecrets) merge by "
        "name, other lists are replaced; `containers: [{name: trainer, ...}]` is the training container.")

    @field_validator("pod_patch", mode="before")
    @classmethod
    def _pod_patch(cls, v: Any) -> Any:
        problems = pod_patch_problems(v)
        if problems:
            raise Problems(problems)
        return v

    @field_validator("extra_resources")
    @classmethod
    def _extra_resources(cls, v: dict[str, str]) -> dict[str, str]:
        problems = [Problem(key, "set by resources.cpus_per_node / resources.memory", "set it there")
                    for key in v if key in ("cpu", "memory")]
        # requests = limits (deploy/k8s/pod.py): the API server's resource rules, as lint has them
        for path, message in api_rules.validate_resources({"limits": v}, ""):
            problems.append(Problem(path.removeprefix("limits."), message,
                                    "a domain-qualified name and a whole number, e.g. rdma/ib: 1"))
        if problems:
            raise Problems(problems)
        return v

    @field_validator("capabilities")
    @classmethod
    def _capabilities(cls, v: list[str]) -> list[str]:
        for cap in v:
            if not re.fullmatch(r"[A-Z][A-Z0-9_]*", cap) or cap.startswith("CAP_"):
                raise ValueError(f"{cap!r} is not a capability name as Kubernetes writes it "
                                 "(IPC_LOCK, SYS_NICE: upper case, without CAP_)")
        return v

    @model_validator(mode="after")
    def _names_and_queue(self) -> Self:
        problems = []
        for key in ("app.kubernetes.io/instance", "app.kubernetes.io/managed-by"):
            if key in self.labels:
                problems.append(Problem(f"labels.{key}", "ddpkit selects the job's pods by this "
                                        "label (the headless Service, `ddpkit logs`); overriding it "
                                        "breaks their DNS names", "remove it"))
        queue = self.labels.get(KUEUE_QUEUE_LABEL)
        if queue is not None and queue != self.queue:
            problems.append(Problem(f"labels.{KUEUE_QUEUE_LABEL}", f"contradicts k8s.queue "
                                    f"({self.queue!r})", "set the queue with k8s.queue only"))
        if self.topology is not None and not self.queue:
            problems.append(Problem("topology", "is Kueue's topology-aware scheduling: it needs k8s.queue",
                                    "set k8s.queue to a LocalQueue whose ClusterQueue's ResourceFlavor "
                                    "names a Topology with this level"))
        names = [c.name for c in [*self.init_containers, *self.sidecars]]
        for i, name in enumerate(names):
            if name in names[:i] or name in ("trainer", "pytorch", "node", "init-pytorch"):
                problems.append(Problem("init_containers" if i < len(self.init_containers) else "sidecars",
                                        f"container name {name} is used twice or taken by ddpkit "
                                        "or an operator", "rename it"))
        if problems:
            raise Problems(problems)
        return self

    @field_validator("labels", "node_selector")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not QUALIFIED_NAME.match(key) or len(key.rsplit("/", 1)[-1]) > 63:
                raise ValueError(f"{key!r} is not a valid label key (prefix/name, name at most 63 chars)")
            if not LABEL_VALUE.match(value) or len(value) > 63:
                raise ValueError(f"label {key}: {value!r} is not a valid label value "
                                 "(letters, digits, '-', '_', '.', at most 63 chars)")
        return v

    @field_validator("annotations", "job_annotations")
    @classmethod
    def _annotations(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not QUALIFIED_NAME.match(key):
                raise ValueError(f"{key!r} is not a valid annotation key")
        return v


_DERIVED_DIRECTIVES = {
    "job-name": "name", "nodes": "nodes", "ntasks": "nodes and slurm.launcher",
    "ntasks-per-node": "slurm.launcher", "gpus": "gpus_per_node", "gpus-per-node": "gpus_per_node and slurm.gpu_type",
    "gpus-per-task": "gpus_per_node",
    "cpus-per-task": "resources.cpus_per_node", "mem": "resources.memory (or slurm.all_memory for --mem=0)",
    "time": "time_limit", "partition": "slurm.partition", "account": "slurm.account",
    "qos": "slurm.qos", "constraint": "slurm.constraint", "exclusive": "slurm.exclusive",
    "output": "slurm.log_dir", "error": "slurm.log_dir", "requeue": "restarts (>= 1)", "no-requeue": "restarts (0)",
    "signal": "slurm.signal", "open-mode": "(always append)",
}
#: sbatch options that contradict what ddpkit renders, and why.
_CONFLICTING_DIRECTIVES = {
    "cpus-per-gpu": "ddpkit sets --cpus-per-task (resources.cpus_per_node) and Slurm refuses both",
    "mem-per-gpu": "ddpkit sets --mem (resources.memory, slurm.all_memory); Slurm allows one memory option",
    "mem-per-cpu": "ddpkit sets --mem (resources.memory, slurm.all_memory); Slurm allows one memory option",
    "ntasks-per-gpu": "ddpkit lays out tasks (slurm.launcher): one per node or one per GPU",
    "ntasks-per-socket": "ddpkit lays out tasks (slurm.launcher): one per node or one per GPU",
    "ntasks-per-core": "ddpkit lays out tasks (slurm.launcher): one per node or one per GPU",
    "export": "the job step needs the environment the script exports (DDPKIT_*, env:); "
              "--export=NONE drops it",
    "export-file": "the job step needs the environment the script exports (DDPKIT_*, env:)",
    "chdir": "paths are relative to the submit directory (logs, checkpoints, the job file); "
             "submit from the directory you want",
    "array": "one ddpkit job is one training run: array tasks would share its name, checkpoints "
             "and FINISHED marker; submit one job per run",
    "wrap": "the script is the job; --wrap replaces it",
    "overcommit": "ddpkit sizes --cpus-per-task to the processes it starts",
    "gpus-per-socket": "ddpkit asks for GPUs per node (gpus_per_node, slurm.gpu_type)",
    "gpu-bind": "trainer.launch gives each process its GPU by LOCAL_RANK",
}


class SlurmSection(Strict):
    """Slurm-only settings."""

    partition: SlurmWord | None = Field(None, description="`--partition`.")
    account: SlurmWord | None = Field(None, description="`--account`.")
    qos: SlurmWord | None = Field(None, description="`--qos`.")
    constraint: str | None = Field(None, description="`--constraint` (node features): `a&b`, "
                                   "`a|b`, counts `a*2`, matching OR `[ib1|ib2]`, sets `[rack1*2&rack2*4]`.")
    exclusive: bool = Field(False, description="`--exclusive`: whole nodes.")
    launcher: Literal["torchrun", "srun"] = Field(
        "torchrun", description="`torchrun`: one task per node running torchrun; `srun`: one "
        "Slurm task per GPU/process, no torchrun.")
    container: Literal["none", "pyxis", "apptainer"] = Field(
        "none", description="Run bare (`none`), in pyxis/enroot (`srun --container-image`), or "
        "with `apptainer exec --nv`.")
    container_mounts: list[str] = Field(
        default=[], description="Extra bind mounts `SRC[:DST][:ro]` for pyxis/Apptainer "
        "(a lone `SRC` mounts at the same path; volumes with host_path are added automatically).")
    venv: str | None = Field(None, description="With container none: a virtualenv or conda "
                             "prefix to activate before launching.")
    modules: list[ModuleName] = Field(default=[], description="`module load` these first.")
    setup: list[str] = Field(default=[], description="Shell lines run before the "
                             "launch, as written (this is the one place for raw shell).")
    requeue: bool = Field(False, description="On the signal before the time limit, checkpoint "
                          "and requeue (at most `restarts` times).")
    spare_nodes: int = Field(0, ge=0, le=64, description="Nodes allocated beyond `nodes` that "
                             "stay idle until one is lost: with `restarts`, a failed job step is "
                             "started again inside the allocation (`--no-kill`) without the nodes "
                             "that stopped answering, from the newest checkpoint. docs/slurm.md \"Restarts "
                             "inside the allocation\".")
    signal: Literal["USR2", "TERM", "INT"] = Field(
        "USR2", description="Signal sent to the batch shell before the time limit (not USR1: NCCL uses it).")
    signal_seconds: int = Field(DEFAULT_STOP_GRACE_S, ge=10, le=65535, description="Send it this many seconds "
                                "before the time limit (sbatch takes at most 65535).")
    log_dir: str = Field("logs", description="Directory of `%x-%j.out` logs (relative to the "
                         "submit directory).")
    gpu_type: Annotated[str, matching(r"[A-Za-z0-9][A-Za-z0-9_.-]*", 64, "a GPU type such as "
                                      "h100 or a100_80gb")] | None = Field(
        None, description="Typed GPUs as the site names them: `h100` gives "
        "`--gpus-per-node=h100:8` (or `--gres=gpu:h100:8`).")
    all_memory: bool = Field(False, description="`--mem=0`: all of each node's memory "
                             "(instead of resources.memory; Slurm only, nothing on Kubernetes).")
    container_remap_root: bool = Field(False, description="pyxis: `--container-remap-root` "
                                       "(root inside the container).")
    container_writable: bool = Field(False, description="A writable container filesystem: "
                                     "pyxis `--container-writable`, Apptainer `--writable-tmpfs`.")
    gpu_flag: Literal["gpus-per-node", "gres"] = Field(
        "gpus-per-node", description="How to ask for GPUs: `--gpus-per-node=N` or, on older "
        "clusters, `--gres=gpu:N`.")
    extra_directives: list[str] = Field(
        default=[], description="More `#SBATCH` options, each `--key=value` or `--flag`; "
        "`--gres=nvme:1` asks for non-GPU resources beside the GPUs (one `--gres` line with them).")

    @field_validator("signal", mode="before")
    @classmethod
    def _signal(cls, v: Any) -> Any:
        name = str(v).upper().removeprefix("SIG")
        if name == "USR1":
            raise ValueError("NCCL uses SIGUSR1 itself; use USR2 (the default) or TERM")
        return name

    @field_validator("container_mounts")
    @classmethod
    def _mounts(cls, v: list[str]) -> list[str]:
        """`SRC[:DST[:ro|rw]]`, as pyxis and Apptainer take them; a lone `SRC` (or `SRC:ro`)
        is mounted at the same path, and written out in full."""
        out = []
        for m in v:
            parts = m.split(":")
            if len(parts) == 1 or (len(parts) == 2 and parts[1] in ("ro", "rw")):
                parts.insert(1, parts[0])
            if not (2 <= len(parts) <= 3) or not all(p.startswith("/") for p in parts[:2]) or (
                len(parts) == 3 and parts[2] not in ("ro", "rw")) or re.search(r"[\s,]", m):
                raise ValueError(f"{m!r} is not SRC[:DST[:ro|rw]] with absolute paths")
            out.append(":".join(parts))
        return out

    @field_validator("constraint")
    @classmethod
    def _constraint(cls, v: str | None) -> str | None:
        if v is not None and not constraint_ok(v):
            raise ValueError(f"{v!r} is not an sbatch --constraint: features joined by & or |, "
                             "counts as NAME*N, one [...] set (e.g. [ib1|ib2] or [rack1*2&rack2*4]), "
                             "( ) to group")
        return v

    @field_validator("setup")
    @classmethod
    def _one_line(cls, v: list[str]) -> list[str]:
        for line in v:
            if "\n" in line or not line.strip():
                raise ValueError(f"{line!r}: one non-empty line per entry")
        return v

    @field_validator("log_dir", "venv")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        if v is not None and (not v or "\n" in v or "%" in v):
            raise ValueError(f"{v!r} is not a usable path (no newlines or '%')")
        return v

    @field_validator("extra_directives")
    @classmethod
    def _directives(cls, v: list[str]) -> list[str]:
        problems = []
        for i, d in enumerate(v):
            match = re.fullmatch(r"--([a-z][a-z0-9-]*)(=[^\s'\"\\$`]+)?", d)
            if not match:
                problems.append(Problem(str(i), f"{d!r} is not an sbatch option",
                                        "write --key=value or --flag (no spaces, quotes or $)"))
                continue
            key = match.group(1)
            if key == "gres":
                problems += gres_problems(str(i), (match.group(2) or "=")[1:])
            elif key in _DERIVED_DIRECTIVES:
                problems.append(Problem(str(i), f"{d!r}: ddpkit derives --{key}",
                                        f"set {_DERIVED_DIRECTIVES[key]} instead"))
            elif key in _CONFLICTING_DIRECTIVES:
                problems.append(Problem(str(i), f"{d!r} conflicts with the script ddpkit renders: "
                                        f"{_CONFLICTING_DIRECTIVES[key]}", "remove it"))
        if problems:
            raise Problems(problems)
        return v


#: The `train:` fields that apply to a job running its own `script`/`module` (the launcher's).
SCRIPT_TRAIN_FIELDS = {"timeout_s", "threads", "watchdog", "hang_floor_s", "hang_factor"}


def _count_problems(model: type[BaseModel], data: dict, path: str) -> list[Problem]:
    """Integer fields of `model` given anything but an integer (a boolean, a string, 2.0)."""
    problems = []
    for name, field in model.model_fields.items():
        value = data.get(name)
        kinds = set(getattr(field.annotation, "__args__", ()) or (field.annotation,)) - {type(None)}
        if name in data and value is not None and kinds == {int} and type(value) is not int:
            problems.append(Problem(f"{path}.{name}", f"expected an integer (got "
                                    f"{type(value).__name__} {value!r:.40})",
                                    "write a whole number without quotes"))
    return problems


def _check_env_name(name: str) -> str:
    if not ENV_NAME.match(name):
        raise ValueError(f"{name!r} is not a valid variable name (letters, digits, '_')")
    reason = reserved_env_reason(name)
    if reason:
        raise ValueError(f"{name} is set by ddpkit, not the job file: {reason}")
    return name


# --------------------------------------------------------------------------------------------
# The job


class JobSpec(Strict):
    """A distributed data-parallel training job, target-independent."""

    name: str = Field(description=f"Job name: DNS-1035 label of at most {MAX_NAME_LEN} "
                      "characters (lowercase letters, digits, '-'), unique per namespace.")
    image: ImageRef = Field(
        description="Container image of the trainer (every target but bare Slurm): a registry "
        "reference (`registry.example/org/trainer:1.0`, every target); Slurm only: a `docker://` URI, an "
        "Apptainer `.sif` file, an enroot `.sqsh` file or `registry#image` "
        "(deploy/image_forms.py).")
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] | None = Field(
        None, description="Kubernetes imagePullPolicy of the trainer and of every init container "
        "and sidecar. Default: Kubernetes' own rule, per container by its image: `Always` for "
        "`:latest` or no tag (a node's cached `:latest` may be old code), `IfNotPresent` for "
        "any other tag or a digest (`@sha256:...`).")
    nodes: Nodes = Field(Nodes(min=1, max=1), description="Node count `N`, or `MIN:MAX` for "
                         "elastic training (PyTorchJob only).")
    gpus_per_node: int = Field(0, ge=0, le=64, description="GPUs per node; 0 = CPU with the "
                               "gloo backend. One process per GPU.")
    gpu_resource: ResourceName = Field(
        "nvidia.com/gpu", description="Kubernetes extended resource name of a GPU (e.g. "
        "`amd.com/gpu`, a MIG slice `nvidia.com/mig-3g.40gb`, `nvidia.com/gpu.shared`). Its "
        "domain names the vendor: Apptainer gets `--nv` for every `nvidia.com/` name, `--rocm` "
        "for `amd.com/` ones; `run --docker` gives `--gpus` for both.")
    procs_per_node: int | None = Field(None, ge=1, le=256, description="Processes per node on "
                                       "CPU jobs (default 1). With GPUs it is gpus_per_node.")
    resources: Resources = Field(default_factory=Resources, description="CPU, memory and shm per node.")
    env: dict[str, EnvValue] = Field(default={}, description="Environment of every "
                                     "process. Values are strings exactly as written: quote "
                                     "numbers (`\"1.10\"`); `$(VAR)` and `$` are passed on "
                                     "literally on every target (no expansion).")
    secret_env: list[SecretEnv] = Field(default=[], description="Variables read from "
                                        "Secrets: `{name, secret, key}`; values never inlined.")
    volumes: list[Volume] = Field(default=[], description="Volumes mounted on every node.")
    command: list[str] | None = Field(None, description="Override the per-node entry point "
                                      "(default `python -m trainer.launch`), as an argv list. "
                                      "This bypasses the launcher; to run your own torchrun "
                                      "script with it, use `script` instead.")
    workdir: Workdir | None = Field(
        None, description="Ship a directory with the job: `workdir: .` (or `{dir, exclude, "
        "max_size}`). docs/WORKLOADS.md \"Your working directory on every target\".")
    script: Script = None
    module: Module = None
    args: Args = Field(default=[])
    steps: Steps = None
    local_rank_arg: LocalRankArg = None
    preflight: bool = Field(False, description="Check the distributed setup before training on "
                            "every node (`python -m trainer.preflight`: master reachable, world "
                            "layout, backend for the device, an all-reduce with a bandwidth figure); "
                            "one verdict line per node, and no training when a check fails.")
    torchrun_args: TorchrunArgs = Field(default=[])
    restarts: int = Field(0, ge=0, le=100, description="Restarts after failure or preemption: "
                          "torchrun `--max-restarts`, backoffLimit, Slurm requeues (after a node "
                          "failure; before the time limit with `slurm.requeue`).")
    time_limit: TimeLimit | None = Field(
        None, description="Wall-clock limit, one meaning on every target: Slurm `--time`, "
        "activeDeadlineSeconds. Units (`90m`, `24h`, `2d`, `1h30m`) or sbatch's forms with "
        "hours (`04:00:00`, `2-12`, `1-12:00:00`); a bare number is refused (sbatch reads "
        "minutes, Kubernetes seconds), as is sbatch's `MM:SS`.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig,
                                         description="Checkpoint directory, interval and retention.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="What the trainer trains "
                               "(owned by `trainer/config.py`).")
    k8s: K8sSection = Field(default_factory=K8sSection, description="Kubernetes settings.")
    slurm: SlurmSection = Field(default_factory=SlurmSection, description="Slurm settings.")

    @model_validator(mode="before")
    @classmethod
    def _counts_are_integers(cls, data: Any) -> Any:
        """The trainer's sections are lax pydantic models (`lr: 1e-3` is a YAML 1.1 string they
        must accept); their counts are still integers, never booleans or `"4"`, like ours."""
        if isinstance(data, dict):
            problems = [p for section in ("train", "checkpoint") if isinstance(data.get(section), dict)
                        for p in _count_problems(cls.model_fields[section].annotation,
                                                 data[section], section)]
            if problems:
                raise Problems(problems)
        return data

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if len(v) > MAX_NAME_LEN:
            raise ValueError(f"{len(v)} characters; at most {MAX_NAME_LEN} so every suffix a "
                             "target adds (e.g. -worker-12) stays a valid DNS name")
        if not DNS1035_LABEL.match(v):
            raise ValueError(f"{v!r} is not a DNS-1035 label: start with a letter, then "
                             "lowercase letters, digits and '-', end with a letter or digit")
        return v

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, v: Any) -> Any:
        if isinstance(v, dict):
            problems = []
            for name in v:
                try:
                    _check_env_name(str(name))
                except ValueError as exc:
                    problems.append(Problem(str(name), str(exc)))
            if problems:
                raise Problems(problems)
        return v

    @field_validator("command")
    @classmethod
    def _command(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or not v[0].strip()):
            raise ValueError("give the program and its arguments as a non-empty list")
        return v

    @model_validator(mode="after")
    def _cross_field(self) -> Self:
        problems = [Problem(*p) for p in entry_problems(self.script, self.module, self.args, self.command,
                                                        self.steps, self.local_rank_arg)]
        if self.script is not None or self.module is not None:
            own = "script" if self.script is not None else "module"
            for section, allowed in (("train", SCRIPT_TRAIN_FIELDS), ("checkpoint", set())):
                values, defaults = getattr(self, section), type(getattr(self, section))()
                unused = [f for f in type(values).model_fields if f not in allowed
                          and getattr(values, f) != getattr(defaults, f)]  # not fields_set: to_yaml fills all
                problems += [Problem(f"{section}.{f}", f"a setting of the built-in trainer; your {own} "
                                     "reads its own", "pass it in args, remove it here") for f in unused]
        problems += self._gpu_problems()
        if self.gpus_per_node and self.procs_per_node not in (None, self.gpus_per_node):
            problems.append(Problem(
                "procs_per_node", f"{self.procs_per_node} must equal gpus_per_node "
                f"({self.gpus_per_node}): one process per GPU", "remove procs_per_node"))
        for field, key in (("name", lambda v: v.name), ("mount", lambda v: v.mount.rstrip("/"))):
            values = [key(v) for v in self.volumes]
            for i, value in enumerate(values):
                if value in values[:i]:
                    problems.append(Problem(f"volumes.{i}.{field}", f"{value} is used twice",
                                            f"give each volume its own {field}"))
                elif field == "name" and value in POD_VOLUMES:
                    problems.append(Problem(f"volumes.{i}.name", f"{value} is the name of ddpkit's own "
                                            f"volume for {POD_VOLUMES[value]} (Kubernetes refuses a "
                                            "pod with two volumes of one name)", "rename it"))
        problems += self._workdir_problems()
        seen = set(self.env)
        for i, secret in enumerate(self.secret_env):
            if secret.name in seen:
                problems.append(Problem(f"secret_env.{i}.name", f"{secret.name} is set twice "
                                        "(env or secret_env)", "keep one"))
            seen.add(secret.name)
        if self.slurm.requeue and self.restarts < 1:
            problems.append(Problem("slurm.requeue", "needs restarts >= 1 (each requeue is one "
                                    "restart)", "set restarts"))
        if self.slurm.gpu_type is not None and not self.gpus_per_node:
            problems.append(Problem("slurm.gpu_type", "names the type of GPUs the job asks for, "
                                    "but gpus_per_node is 0", "set gpus_per_node or remove gpu_type"))
        if self.slurm.all_memory and self.resources.memory is not None:
            problems.append(Problem("slurm.all_memory", f"asks for all of each node's memory, "
                                    f"and resources.memory asks for {self.resources.memory}",
                                    "keep one of them"))
        if problems:
            raise Problems(problems)
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler) -> dict[str, Any]:
        """The fields; a job without a workdir reads as it did before the field existed."""
        data = handler(self)
        if data.get("workdir", ...) is None:
            del data["workdir"]
        return data

    def _workdir_problems(self) -> list[Problem]:
        """With a workdir, the script is a path inside it, and its mount path is ddpkit's
        (what is in the tree is deploy/workdir.py's to check, at render and submit)."""
        if self.workdir is None:
            return []
        problems = []
        if self.script is not None:
            parts = self.script.replace("\\", "/").split("/")
            if self.script.startswith("/") or ".." in parts:
                problems.append(Problem("script", f"{self.script} is outside workdir "
                                        f"{self.workdir.dir!r}: the nodes run the snapshot of "
                                        "that tree, and only what is in it",
                                        "give the script's path relative to workdir.dir, inside it"))
        for i, volume in enumerate(self.volumes):
            mount = volume.mount.rstrip("/") or "/"
            if mount == WORKDIR_MOUNT or WORKDIR_MOUNT.startswith(mount + "/") or mount.startswith(WORKDIR_MOUNT + "/"):
                problems.append(Problem(f"volumes.{i}.mount", f"{volume.mount}: the pods' copy of "
                                        f"the workdir is mounted at {WORKDIR_MOUNT}", "mount it elsewhere"))
            if volume.name in WORKDIR_VOLUMES:
                problems.append(Problem(f"volumes.{i}.name", f"{volume.name} is the name of ddpkit's "
                                        f"own volume for {WORKDIR_VOLUMES[volume.name]}", "rename it"))
        return problems

    @property
    def base_dir(self) -> Path:
        """The directory the job file's relative paths (`workdir.dir`) are read from: the job
        file's own; the current directory for a job not read from a file."""
        return Path(self._origin[0]).parent

    def _gpu_problems(self) -> list[Problem]:
        """A GPU job that would not get its GPUs, or would take others' (trainer/gpus.py is
        the node-side half)."""
        gpus, device = self.gpus_per_node, self.train.device
        problems = []
        if gpus and device == "cpu":
            problems.append(Problem("train.device", f"is cpu but gpus_per_node is {gpus}: the job would "
                                    "hold its GPUs and train on CPU", "set gpus_per_node: 0, or device: auto"))
        if not gpus and device == "cuda":
            problems.append(Problem("train.device", "is cuda but gpus_per_node is 0: the job asks for no "
                                    "GPU, so any it found would be another job's", "set gpus_per_node"))
        if gpus > 1 and self.gpu_resource.startswith(MIG_RESOURCE_PREFIX):
            problems.append(Problem("gpus_per_node", f"{gpus} slices of {self.gpu_resource}: a CUDA process "
                                    "sees only one MIG device, so the other ranks of a node would find none",
                                    "set gpus_per_node: 1 and use more nodes (one rank per slice)"))
        if gpus and "NVIDIA_VISIBLE_DEVICES" in self.env:
            problems.append(Problem("env.NVIDIA_VISIBLE_DEVICES", "overrides the GPUs that the device plugin "
                                    "or enroot assigned to this job", "remove it; gpus_per_node asks for GPUs"))
        return problems

    # ---- where a field was written: the line map of the job file it came from ------------------

    _origin: tuple = PrivateAttr(default=("job.yaml", {}, frozenset()))

    def where(self, path: str | tuple) -> str:
        """`FILE:LINE` of a dotted field path (its nearest written parent), or `--set KEY`."""
        loc = tuple(int(p) if isinstance(p, str) and p.isdigit() else p
                    for p in (path.split(".") if isinstance(path, str) else path))
        return locate(loc, *self._origin)

    def __eq__(self, other: object) -> bool:
        """Equal jobs are equal wherever they were read from (the origin is not compared)."""
        return isinstance(other, JobSpec) and self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]

    # ---- derived topology: the one source every renderer uses --------------------------------

    @property
    def nproc_per_node(self) -> int:
        """Processes per node: one per GPU, else procs_per_node (default 1)."""
        return self.gpus_per_node or self.procs_per_node or 1

    @property
    def world_size(self) -> int:
        """Processes in total (at the maximum node count for elastic jobs)."""
        return self.nodes.max * self.nproc_per_node

    @property
    def backend(self) -> str:
        return "nccl" if self.gpus_per_node else "gloo"

    def to_yaml(self) -> str:
        """The normalised job (overrides applied, defaults filled): what every node reads."""
        return yaml.dump(self.model_dump(mode="json"), Dumper=Dumper, sort_keys=False, width=100)
