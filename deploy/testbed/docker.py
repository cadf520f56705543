"""`ddpkit testbed docker up|down|status`: a Docker engine and a base image, without a registry.

For machines like our CI: root, Debian, package mirrors reachable, no container registry. `up`
installs Debian's `docker.io` and `debootstrap` when missing, starts `dockerd` unless a daemon
already answers (and remembers the PID of the one it started), and makes the base image
`ddpkit-base:bookworm` when the daemon lacks it: `debootstrap --variant=minbase` with Debian's
python3 and venv module (the image's python; the torch cp311 wheel matches it), imported with
`docker import`. `down` stops only a daemon that `up` started, by its PID. Then
`ddpkit image build --offline --base-image ddpkit-base:bookworm` builds the training image.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deploy.errors import RuntimeFailure, UserError
from deploy.image import docker, docker_binary, docker_env, image_exists
from deploy.testbed import apt_install, run_action

BASE_IMAGE = "ddpkit-base:bookworm"
SUITE = "bookworm"
PACKAGES = ["docker.io", "debootstrap"]


def testbed_dir() -> Path:
    return Path(os.environ.get("DDPKIT_DOCKER_TESTBED_DIR", "/tmp/ddpkit-docker-testbed"))


def _pid_file() -> Path:
    return testbed_dir() / "dockerd.pid"


def daemon_up() -> bool:
    try:
        return docker("version", "--format", "{{.Server.Version}}", check=False,
                      timeout=15).returncode == 0
    except RuntimeFailure:  # no client installed
        return False


def _ensure_packages() -> None:
    missing = [p for p, cmd in (("docker.io", "/usr/bin/docker"), ("debootstrap", "debootstrap"))
               if shutil.which(cmd) is None]
    if missing:
        apt_install(missing)


def start_daemon(timeout: float = 60) -> None:
    """Start dockerd in the background (the Debian package cannot start it without an init
    system) and wait until it answers."""
    testbed_dir().mkdir(parents=True, exist_ok=True)
    # dockerd refuses to start while its pid file names a live process, even an unrelated one
    # that reused the PID of a daemon killed without clean-up
    stale = Path("/var/run/docker.pid")
    try:
        if not _is_dockerd(int(stale.read_text())):
            stale.unlink()
    except (OSError, ValueError):
        pass
    log = open(testbed_dir() / "dockerd.log", "ab")
    proc = subprocess.Popen(["dockerd", "--storage-driver=overlay2"], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    _pid_file().write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeFailure(f"dockerd exited with {proc.returncode}; see "
                                 f"{testbed_dir() / 'dockerd.log'}")
        if daemon_up():
            return
        time.sleep(0.5)
    raise RuntimeFailure(f"dockerd did not answer within {timeout:.0f} s; see "
                         f"{testbed_dir() / 'dockerd.log'}")


def make_base_image(name: str = BASE_IMAGE) -> None:
    """A minimal Debian with python3 + venv, as a local image (about 50 s, 265 MB)."""
    with tempfile.TemporaryDirectory(prefix="ddpkit-rootfs-") as tmp:
        root = Path(tmp) / "rootfs"
        print(f"testbed: debootstrap {SUITE} -> {name}", file=sys.stderr)
        # rdma-core's verbs library and providers, as ddpkit's image installs them when online
        boot = subprocess.run(["debootstrap", "--variant=minbase",
                               "--include=python3-venv,libibverbs1,ibverbs-providers",
                               SUITE, str(root)], capture_output=True, text=True)
        if boot.returncode != 0:
            tail = (boot.stderr or boot.stdout).strip().splitlines()[-1:]
            raise RuntimeFailure(f"debootstrap failed: {tail[0] if tail else boot.returncode}")
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run([docker_binary(), "import", "-", name], stdin=tar.stdout,
                                  env=docker_env(), capture_output=True, text=True)
        tar.wait()
        if imported.returncode != 0 or tar.returncode != 0:
            raise RuntimeFailure(f"docker import failed: {imported.stderr.strip()}")


def up() -> None:
    if os.geteuid() != 0:
        raise UserError("ddpkit testbed docker needs root (dockerd, debootstrap): use sudo")
    _ensure_packages()
    if not daemon_up():
        start_daemon()
    if not image_exists(BASE_IMAGE):
        make_base_image()
    prune()
    print(f"testbed: docker up; base image {BASE_IMAGE}", file=sys.stderr)


#: what `up` leaves of BuildKit's cache: the training image's layers (torch's is ~1.1 GB) twice
BUILD_CACHE_KEPT = "4GB"


def prune() -> None:
    """Bound what repeated builds leave on disk: untagged images, and BuildKit's cache down to
    BUILD_CACHE_KEPT. Every rebuild of the test image (a new context) adds a layer of torch and
    the project to the cache, which nothing else collects: on this project's CI machine it
    reached 31 GB after a few days of runs and filled the disk mid-run (`docker save`: no space
    left on device)."""
    docker("image", "prune", "--force", check=False, timeout=300)
    freed = docker("builder", "prune", "--force", "--keep-storage", BUILD_CACHE_KEPT,
                   check=False, timeout=600)
    last = (freed.stdout or "").strip().splitlines()
    if last:
        print(f"testbed: build cache pruned to {BUILD_CACHE_KEPT}: {last[-1]}", file=sys.stderr)


def down() -> None:
    """Stop the dockerd that `up` started (by its PID); leave any other daemon alone."""
    try:
        pid = int(_pid_file().read_text())
    except (OSError, ValueError):
        print("testbed: no dockerd started by `testbed docker up`; nothing to stop", file=sys.stderr)
        return
    if not _is_dockerd(pid):  # a stale file from an earlier boot: the PID may be anyone's now
        _pid_file().unlink(missing_ok=True)
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    _pid_file().unlink(missing_ok=True)


def _is_dockerd(pid: int) -> bool:
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return False
    return Path(argv0.decode(errors="replace")).name == "dockerd"


def _alive(pid: int) -> bool:
    """Running and not a zombie (a killed daemon lingers as one until reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def status() -> bool:
    """Print whether the daemon runs and the base image exists; True when both do."""
    ok = daemon_up() and image_exists(BASE_IMAGE)
    print(f"docker daemon {'up' if daemon_up() else 'down'}; base image {BASE_IMAGE} "
          f"{'present' if ok else 'missing'}")
    return ok


def main(action: str) -> int:
    """The CLI's `testbed docker ACTION`."""
    return run_action("docker", action, up=up, down=down, status=status)
