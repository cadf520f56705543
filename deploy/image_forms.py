"""The image forms a job's `image:` may take, and what each target makes of them.

Users have images in several forms, and each runtime reads a different one:

| form | example | Kubernetes, Docker | Apptainer | pyxis/enroot |
|---|---|---|---|---|
| registry reference | `registry.example/org/trainer:1.0` | as is | `docker://registry.example/org/trainer:1.0` | `registry.example#org/trainer:1.0` |
| `docker://` URI | `docker://registry.example/org/trainer:1.0` | refused | as is | `registry.example#org/trainer:1.0` |
| Apptainer image | `/images/trainer.sif` | refused | as is | refused |
| enroot squashfs | `/images/trainer.sqsh` | refused | refused | as is |
| enroot `registry#image` | `registry.example#nvidia/pytorch:24.05-py3` | refused | `docker://registry.example/nvidia/pytorch:24.05-py3` | as is |

A registry reference whose first component has no `.` or `:` (and is not `localhost`) is on
Docker Hub (`pytorch/pytorch:2.3`, `ubuntu`), as Docker and Kubernetes read it; enroot needs no
`registry#` for those. Local files (`.sif`, `.sqsh`) are paths on the cluster's nodes, absolute
or relative to the submit directory; a relative `.sqsh` is given to pyxis as `./PATH`, since
pyxis reads `PATH` alone (not starting with `/` or `.`) as a registry image name.
"""

from __future__ import annotations

from deploy.problems import Problem

#: A registry reference, a `docker://` URI, an enroot `registry#image`, or a `.sif`/`.sqsh` path.
IMAGE_PATTERN = r"(docker://)?[A-Za-z0-9][A-Za-z0-9._/:@#-]*|[A-Za-z0-9._/-]*\.(sif|sqsh)"


def form(image: str) -> str:
    """`registry`, `docker-uri`, `sif`, `sqsh` or `enroot` (the `registry#image` form)."""
    if image.endswith(".sif"):
        return "sif"
    if image.endswith(".sqsh"):
        return "sqsh"
    if image.startswith("docker://"):
        return "docker-uri"
    if "#" in image:
        return "enroot"
    return "registry"


def _split_registry(ref: str) -> tuple[str | None, str]:
    """`registry.example/org/x:1` -> ("registry.example", "org/x:1"); a Docker Hub name -> (None, name)."""
    first, sep, rest = ref.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return first, rest
    return None, ref


def _registry_ref(image: str) -> str:
    """The plain registry reference of a registry, `docker://` or `registry#image` form."""
    if image.startswith("docker://"):
        return image.removeprefix("docker://")
    if "#" in image:
        registry, _, rest = image.partition("#")
        return f"{registry}/{rest}"
    return image


def apptainer(image: str) -> str:
    """What `apptainer exec` is given (a local .sif, else a docker:// URI)."""
    if form(image) == "sif":
        return image
    return "docker://" + _registry_ref(image)


def pyxis(image: str) -> str:
    """What `srun --container-image` (pyxis/enroot) is given (a local .sqsh, else
    `registry#image`, or just the image for Docker Hub)."""
    if form(image) == "sqsh":
        # pyxis reads the image as a squashfs file only when it starts with / or . (pyxis_slurmstepd.c:
        # `strspn(image, "./") > 0`), else as a registry name: a path relative to the submit
        # directory (srun's working directory) is given as ./PATH
        return image if image[0] in "./" else "./" + image
    registry, rest = _split_registry(_registry_ref(image))
    return f"{registry}#{rest}" if registry else rest


def pull_policy(image: str) -> str:
    """Kubernetes' own default imagePullPolicy for a registry reference (kubernetes
    pkg/apis/core/v1/defaults.go `SetDefaults_Container`: `Always` when `ParseImageName` gives
    the tag `latest`, which it also gives a reference with neither tag nor digest; else
    `IfNotPresent`). So `trainer`, `trainer:latest` and `trainer:latest@sha256:...` are pulled
    on every start (a node's cached `:latest` may be old code); `trainer:1.0` and
    `trainer@sha256:...` (a digest pins the content) are pulled when missing."""
    name, _, digest = image.partition("@")
    last = name.rsplit("/", 1)[-1]
    tag = last.rpartition(":")[2] if ":" in last else ""
    if not tag and not digest:
        tag = "latest"
    return "Always" if tag == "latest" else "IfNotPresent"


def problems(image: str, runtime: str) -> list[Problem]:
    """What `runtime` (`k8s`, `apptainer`, `pyxis`, `none`) cannot do with `image`."""
    kind = form(image)
    if kind != "registry" and runtime == "k8s":
        plain = _registry_ref(image)
        fix = (f"use the registry reference {plain!r}" if kind in ("docker-uri", "enroot")
               else "push the image to a registry and give its reference (e.g. registry.example/org/trainer:1.0)")
        return [Problem("image", f"{image!r} is a Slurm-only image form ({kind}); a Kubernetes "
                        "pod pulls images from a registry", fix)]
    if kind == "sqsh" and runtime == "apptainer":
        return [Problem("image", f"{image!r} is an enroot squashfs image; Apptainer runs .sif "
                        "files and registry images", "use slurm.container: pyxis, or a .sif or "
                        "registry image")]
    if kind == "sif" and runtime == "pyxis":
        return [Problem("image", f"{image!r} is an Apptainer image; pyxis/enroot runs .sqsh "
                        "files and registry images", "use slurm.container: apptainer, or a "
                        ".sqsh or registry image")]
    return []
