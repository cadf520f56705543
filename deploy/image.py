"""`ddpkit image build`: the training image, online or from a prepared wheelhouse.

Offline (`--offline`) is the path for air-gapped sites and for our CI, where no registry and no
package index is reachable from inside a build: the host prepares every wheel the image needs
(`pip wheel`, which also turns source-only packages into wheels), and the Dockerfile installs
them with `pip --no-index` from a BuildKit bind mount of `wheelhouse/`, so they never land in a
layer. The base image must then already be on the daemon (`--base-image`, e.g. a Debian made
with debootstrap and `docker import`).

Docker is driven through its CLI (no Python client dependency). BuildKit is required for
`RUN --mount`; `DDPKIT_DOCKER` picks the client binary.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from deploy import __version__
from deploy.errors import RuntimeFailure, UserError

REPO = Path(__file__).resolve().parent.parent
#: The tag the examples use (`image: ddpkit:0.1`).
DEFAULT_TAG = "ddpkit:" + ".".join(__version__.split(".")[:2])


def docker_binary() -> str:
    """The docker client to use: `$DDPKIT_DOCKER`, else the distribution's `/usr/bin/docker`,
    else the first `docker` on PATH.

    The distribution client comes first because a newer standalone client without the buildx
    plugin refuses `DOCKER_BUILDKIT=1`, while the packaged one builds with BuildKit as is.
    """
    chosen = os.environ.get("DDPKIT_DOCKER")
    if chosen:
        return chosen
    if os.access("/usr/bin/docker", os.X_OK):
        return "/usr/bin/docker"
    found = shutil.which("docker")
    if not found:
        raise RuntimeFailure("docker is not installed (or set DDPKIT_DOCKER to the client binary)")
    return found


def docker_env() -> dict[str, str]:
    return {**os.environ, "DOCKER_BUILDKIT": "1"}


def docker(*args: str, check: bool = True, capture: bool = True,
           timeout: float | None = 120) -> subprocess.CompletedProcess:
    """Run one docker CLI command; a failure becomes a one-line RuntimeFailure."""
    cmd = [docker_binary(), *args]
    try:
        proc = subprocess.run(cmd, env=docker_env(), text=True, timeout=timeout,
                              capture_output=capture)
    except FileNotFoundError:
        raise RuntimeFailure(f"docker client {cmd[0]!r} not found") from None
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout or "").strip().splitlines()
        last = detail[-1] if detail else f"exit code {proc.returncode}"
        raise RuntimeFailure(f"docker {args[0]} failed: {last}")
    return proc


def require_daemon() -> None:
    proc = docker("version", "--format", "{{.Server.Version}}", check=False, timeout=30)
    if proc.returncode != 0:
        raise RuntimeFailure("cannot reach the Docker daemon: start dockerd (or check "
                             "DOCKER_HOST / permissions on the socket)")


def image_exists(ref: str) -> bool:
    return docker("image", "inspect", ref, check=False, timeout=30).returncode == 0


def _project_requirements() -> list[str]:
    """What the wheelhouse must hold: the project with its `train` extra and the build backend."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise RuntimeFailure("reading pyproject.toml needs Python >= 3.11 (or the tomli "
                                 "package) on the host") from None
    data = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    return [f"{REPO}[train]", *data["build-system"]["requires"]]


def fill_wheelhouse(wheelhouse: Path, python: str = sys.executable) -> None:
    """Make `wheelhouse` hold every wheel the image build installs.

    First try without the index: if pip resolves everything from what is already there, the
    wheelhouse is complete and nothing is fetched. Otherwise fetch what is missing. The wheels
    are for the host's Python version and platform, which must match the image's python.
    """
    wheelhouse.mkdir(parents=True, exist_ok=True)
    base = [python, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check",
            "--wheel-dir", str(wheelhouse), "--find-links", str(wheelhouse)]
    reqs = _project_requirements()
    if subprocess.run([*base, "--no-index", *reqs], capture_output=True).returncode != 0:
        print(f"filling wheelhouse {wheelhouse} (pip wheel {' '.join(reqs)})", file=sys.stderr)
        proc = subprocess.run([*base, *reqs], capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeFailure(f"could not fill the wheelhouse {wheelhouse}: {tail}")
    for own in wheelhouse.glob("ddpkit-*.whl"):  # the image builds ddpkit from the source
        own.unlink()


def _stage_wheelhouse(source: Path) -> None:
    """Expose `source` to the build as `wheelhouse/` in the build context (hard links where the
    file system allows, copies otherwise): the daemon only sees files inside the context."""
    target = REPO / "wheelhouse"
    if source.resolve() == target.resolve():
        return
    target.mkdir(exist_ok=True)
    for old in target.glob("*.whl"):
        old.unlink()
    for wheel in source.glob("*.whl"):
        try:
            os.link(wheel, target / wheel.name)
        except OSError:
            shutil.copy2(wheel, target / wheel.name)


def default_base_image() -> str:
    """The Dockerfile's own `ARG BASE_IMAGE=` default (one source for it)."""
    match = re.search(r"^ARG BASE_IMAGE=(\S+)", (REPO / "Dockerfile").read_text(), re.MULTILINE)
    if not match:
        raise RuntimeFailure("the Dockerfile has no `ARG BASE_IMAGE=` default")
    return match.group(1)


def _revision() -> str:
    proc = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else "unknown"


def build_image(tag: str = DEFAULT_TAG, *, offline: bool = False, wheelhouse: str | None = None,
                base_image: str | None = None, quiet: bool = False,
                no_cache: bool = False) -> float:
    """Build the image; return the seconds the `docker build` took."""
    if not (REPO / "Dockerfile").is_file():
        raise RuntimeFailure(f"no Dockerfile in {REPO}: `ddpkit image build` works from a "
                             "source checkout")
    require_daemon()
    if wheelhouse and not offline:
        raise UserError("--wheelhouse applies to --offline builds only")
    (REPO / "wheelhouse").mkdir(exist_ok=True)  # the Dockerfile bind-mounts it in every mode
    if offline:
        base = base_image or default_base_image()
        if not image_exists(base):
            raise UserError(f"--base-image {base}: not on this Docker daemon, and an offline "
                            "build cannot pull it; `docker load` it, or pass an image it has "
                            "(e.g. a Debian made with debootstrap and `docker import`)")
        source = Path(wheelhouse) if wheelhouse else REPO / "wheelhouse"
        fill_wheelhouse(source)
        _stage_wheelhouse(source)
    args = ["build", "--tag", tag, "--build-arg", f"VERSION={__version__}",
            "--build-arg", f"REVISION={_revision()}", "--build-arg", f"OFFLINE={int(offline)}"]
    if base_image:
        args += ["--build-arg", f"BASE_IMAGE={base_image}"]
    if quiet:
        args.append("--quiet")
    if no_cache:
        args.append("--no-cache")
    start = time.monotonic()
    proc = docker(*args, str(REPO), check=False, capture=quiet, timeout=3600)
    elapsed = time.monotonic() - start
    if proc.returncode != 0:
        detail = (proc.stderr or "").strip().splitlines() if quiet else []
        raise RuntimeFailure(f"docker build failed{': ' + detail[-1] if detail else ''}")
    return elapsed


def image_size(ref: str) -> int:
    return int(docker("image", "inspect", "--format", "{{.Size}}", ref).stdout.strip())


def main(args) -> int:
    """`ddpkit image build [--offline] [--wheelhouse DIR] [--base-image IMG] [--tag TAG]`."""
    tag = args.tag or DEFAULT_TAG
    elapsed = build_image(tag, offline=args.offline, wheelhouse=args.wheelhouse,
                          base_image=args.base_image)
    print(f"built {tag} in {elapsed:.1f} s, {image_size(tag) / 1e9:.2f} GB")
    return 0


# -- workdir: the tree as a thin image layer (deploy/workdir.py `Snapshot.image`) --------------

#: What the layer's Dockerfile does: the tree in /workdir, owned by the image's user (uid 1000 in
#: ddpkit's image: a script may write beside itself, as in the ConfigMap's emptyDir), and the
#: working directory there (a TrainJob's container cannot set one).
WORKDIR_DOCKERFILE = ("FROM {base}\nCOPY --chown=1000:1000 . /workdir\nWORKDIR /workdir\n"
                      "LABEL io.ddpkit.workdir-sha256={digest}\n")


def build_workdir_image(base: str, snap, tag: str) -> float:
    """Build `tag`: `base` plus the snapshot `snap` in /workdir (BuildKit; an unchanged tree on an
    unchanged base is Docker's cache, about a second); the seconds it took."""
    import tempfile

    require_daemon()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ddpkit-workdir-image-") as tmp:
        context, _ = snap.write(Path(tmp), "tree")  # only the shipped files, checked against the hash
        dockerfile = WORKDIR_DOCKERFILE.format(base=base, digest=snap.digest)
        try:
            proc = subprocess.run([docker_binary(), "build", "--quiet", "--tag", tag, "-f", "-", str(context)],
                                  input=dockerfile, env=docker_env(), text=True, capture_output=True, timeout=3600)
        except FileNotFoundError:
            raise RuntimeFailure(f"docker client {docker_binary()!r} not found: workdir.image builds "
                                 "the tree's image with Docker on this host") from None
    if proc.returncode != 0:
        detail = (proc.stderr or "").strip().splitlines()
        raise RuntimeFailure(f"building {tag} (FROM {base}) failed: {detail[-1] if detail else proc.returncode}")
    return time.monotonic() - start


def push(tag: str) -> float:
    """`docker push tag` (layers the registry has are not sent again); the seconds it took."""
    start = time.monotonic()
    docker("push", "--quiet", tag, timeout=3600)
    return time.monotonic() - start
