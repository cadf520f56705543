"""`ddpkit run --docker` for real: the image built offline, the rendered pods as containers.

Needs a Docker daemon and the base image `ddpkit-base:bookworm` (`sudo ddpkit testbed docker
up` makes both; .ci/run does it in CI). On a laptop without them these tests skip with the
reason; with CI=true they fail instead. The image is (re)built once per session from the
working tree (`ddpkit image build --offline`; a few seconds when only code changed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, ddpkit, docker_test_image

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BASE_IMAGE = os.environ.get("DDPKIT_TEST_BASE_IMAGE", "ddpkit-base:bookworm")
IMAGE = "ddpkit:test"
QUICK = (REPO / "examples" / "quickstart-2node.yaml").read_text()


def docker(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    from deploy.image import docker_binary

    return subprocess.run([docker_binary(), *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def image() -> str:
    return docker_test_image(IMAGE, BASE_IMAGE)


def clear_leftovers(name: str) -> None:
    """Remove what an earlier, killed session left under this test's names: `leftovers` must
    see only this run (a CI run once failed on two exited containers of a run killed earlier)."""
    containers, networks = leftovers(name)
    if containers:
        docker("rm", "--force", *containers.split())
    if networks:
        docker("network", "rm", *networks.split())
    assert leftovers(name) == ("", "")


def job_file(tmp_path: Path, name: str, extra: str = "") -> Path:
    """quickstart-2node (2 nodes x 2 CPU processes) under another name, with this image; nothing
    of an earlier run of the same name left on the daemon."""
    clear_leftovers(name)
    path = tmp_path / f"{name}.yaml"
    path.write_text(QUICK.replace("name: quickstart-2node", f"name: {name}")
                    .replace("image: ddpkit:0.1", f"image: {IMAGE}") + extra)
    return path


def leftovers(name: str) -> tuple[str, str]:
    containers = docker("ps", "-a", "--filter", f"name={name}", "--format", "{{.Names}}").stdout
    networks = docker("network", "ls", "--filter", f"name=ddpkit-{name}", "--format", "{{.Name}}").stdout
    return containers.strip(), networks.strip()


# Pods start together, so the master's name may not exist yet: retry, as trainer.launch does.
PROBE = """
import os, socket, time
rank = os.environ.get("PET_NODE_RANK") or os.environ["JOB_COMPLETION_INDEX"]
master = os.environ.get("PET_MASTER_ADDR") or os.environ["DDPKIT_MASTER_ADDR"]
me = socket.gethostname()
for _ in range(120):
    try:
        address = socket.gethostbyname(master)
        break
    except OSError:
        time.sleep(0.25)
shm = os.statvfs("/dev/shm")
print("probe", rank, me, socket.gethostbyname(me), master, address, shm.f_blocks * shm.f_frsize,
      flush=True)
time.sleep(5)  # stay up until the peer has looked us up
"""


@pytest.mark.parametrize("flavor", ["pytorchjob", "trainjob", "jobset", "job"])
def test_pods_see_their_controller_env_and_resolve_the_master(image, tmp_path, flavor):
    name = f"e2e-probe-{flavor}"
    path = job_file(tmp_path, name, f"command: [python, -c, {json.dumps(PROBE)}]\n")
    result = ddpkit("run", str(path), "--docker", "--flavor", flavor, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    probes = {}
    for line in result.stdout.splitlines():
        prefix, _, rest = line.partition(" probe ")
        if rest:
            probes[prefix] = rest.split()
    assert set(probes) == {"[node 0]", "[node 1]"}, result.stdout
    node0, node1 = probes["[node 0]"], probes["[node 1]"]
    assert (node0[0], node1[0]) == ("0", "1")
    assert node0[1] != node1[1]  # two pods, two hostnames
    # both resolve the master's in-cluster name to pod 0's address
    assert node0[3] == node1[3] and node1[4] == node0[2] == node0[4]
    assert node0[5] == node1[5] == str(512 * 2**20)  # /dev/shm sized like the manifest's emptyDir
    assert leftovers(name) == ("", "")


@pytest.mark.parametrize("flavor", ["pytorchjob", "job"])
def test_two_nodes_by_two_processes_train_to_identical_parameters(image, tmp_path, flavor):
    name = f"e2e-ddp-{flavor}"
    path = job_file(tmp_path, name, "volumes: [{name: runs, claim: runs, mount: /workspace/runs}]\n")
    result = ddpkit("run", str(path), "--docker", "--flavor", flavor, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    assert "[node 0] " in result.stdout and "[node 1] " in result.stdout
    summary = json.loads(next(line.split("ddpkit-summary ", 1)[1]
                              for line in result.stdout.splitlines() if "ddpkit-summary " in line))
    assert summary["status"] == "completed" and summary["world_size"] == 4
    assert summary["params_identical"] is True
    assert len(summary["hostnames"]) == 2  # ranks really were spread over two containers
    # every rank's checksum landed on the shared claim, all equal
    run_dir = tmp_path / "runs" / f"{name}-docker-{flavor}" / "volumes" / "claim-runs" / name
    sums = {p.name: p.read_text().strip() for p in run_dir.glob("params-rank*.sha256")}
    assert sorted(sums) == [f"params-rank{r}.sha256" for r in range(4)]
    assert len(set(sums.values())) == 1 and summary["final_params_sha256"] in sums.values()
    assert (run_dir / "checkpoints" / "FINISHED").exists()
    assert "identical on every rank" in result.stdout
    assert leftovers(name) == ("", "")


def test_a_failing_pod_fails_the_job_with_its_exit_code(image, tmp_path):
    name = "e2e-fail"
    # the master sleeps for longer than the command may run: exit 7 at all means it was
    # stopped, not waited for (behaviour, not a timing)
    script = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(7)\ntime.sleep(3600)\n"
    path = job_file(tmp_path, name, f"command: [python, -c, {json.dumps(script)}]\n")
    result = ddpkit("run", str(path), "--docker", "--flavor", "pytorchjob", cwd=tmp_path, timeout=300)
    assert result.returncode == 7, result.stdout[-3000:] + result.stderr[-3000:]
    assert "e2e-fail-worker-0 failed with exit code 7" in result.stdout
    assert leftovers(name) == ("", "")


def test_ctrl_c_stops_and_removes_every_container_and_the_network(image, tmp_path):
    name = "e2e-ctrlc"
    path = job_file(tmp_path, name, "command: [sleep, '300']\n")
    # Ctrl-C as a terminal sends it: SIGINT with its default disposition. A test run started in
    # the background (`cmd &` in a script, as a CI harness may) inherits SIGINT *ignored*, and
    # Python then installs no KeyboardInterrupt handler: the run never saw the signal, the test
    # killed it, and its containers were left for the next run to trip over.
    proc = subprocess.Popen([sys.executable, "-m", "deploy", "run", str(path), "--docker"],
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            running = docker("ps", "--filter", f"name={name}", "--format", "{{.Names}}").stdout.split()
            if len(running) == 2:
                break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.5)
        assert len(running) == 2, "the two pods never ran"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)  # sleep exits on SIGTERM through --init at once
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert leftovers(name) == ("", "")


# restarts: 1 on 2 nodes: PyTorchJob's backoffLimit is restarts x nodes + 1 (the operator fails
# the job when the restarts of all pods reach it; see deploy/k8s/pytorchjob/__init__.py, verified on the
# testbed by tests/test_k8s_e2e.py), JobSet's maxRestarts is restarts
@pytest.mark.parametrize("flavor, message", [("pytorchjob", "restarting it (1/2, runPolicy.backoffLimit 3"),
                                             ("jobset", "restarting every pod (1/1")])
def test_a_failed_pod_is_restarted_as_its_controller_would(image, tmp_path, flavor, message):
    name = f"e2e-restart-{flavor}"
    script = ("import os, sys, time\n"
              "node = os.environ.get('PET_NODE_RANK') or os.environ['JOB_COMPLETION_INDEX']\n"
              "print('started', node, flush=True)\n"
              "marker = '/workspace/runs/failed-once'\n"
              "if node == '1' and not os.path.exists(marker):\n"
              "    open(marker, 'w').close(); sys.exit(3)\n"
              "time.sleep(3)\n")
    path = job_file(tmp_path, name, f"command: [python, -c, {json.dumps(script)}]\n"
                    "volumes: [{name: runs, claim: runs, mount: /workspace/runs}]\n")
    result = ddpkit("run", str(path), "--docker", "--flavor", flavor, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert message in result.stdout
    starts = [line.split(" started ")[1] for line in result.stdout.splitlines() if " started " in line]
    # the pod restarts alone (PyTorchJob) or with every other pod (JobSet)
    assert sorted(starts) == (["0", "1", "1"] if flavor == "pytorchjob" else ["0", "0", "1", "1"])
    assert leftovers(name) == ("", "")


def test_a_pod_that_cannot_start_fails_at_once_without_restarts(image, tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has GPUs: a GPU request would start")
    name = "e2e-nogpu"
    path = job_file(tmp_path, name, "gpus_per_node: 2\n")
    result = ddpkit("run", str(path), "--docker", "--flavor", "job", cwd=tmp_path, timeout=120)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "could not start" in result.stdout and "restarting" not in result.stdout
    assert leftovers(name) == ("", "")


@pytest.mark.parametrize("flavor", ["pytorchjob", "job"])
def test_your_own_torchrun_script_runs_unchanged_in_the_pods(image, tmp_path, flavor):
    """examples/own_script/train.py baked into an image made FROM ddpkit's (the documented way
    to ship a script), run as `script:` by the rendered pods: 2 nodes x 2 ranks, identical."""
    from deploy.image import docker_binary, docker_env

    own_image = "ddpkit-own-script:test"
    shutil.copy(REPO / "examples" / "own_script" / "train.py", tmp_path / "train.py")
    (tmp_path / "Dockerfile").write_text(f"FROM {image}\nCOPY train.py /workspace/train.py\n")
    built = subprocess.run([docker_binary(), "build", "-q", "-t", own_image, str(tmp_path)],
                           env=docker_env(), capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    name = f"e2e-own-{flavor}"
    path = tmp_path / f"{name}.yaml"
    job = (REPO / "examples" / "own-script.yaml").read_text()
    path.write_text(job.replace("name: own-script", f"name: {name}").replace("image: ddpkit:0.1", f"image: {own_image}")
                    .replace("nodes: 1", "nodes: 2").replace("script: examples/own_script/train.py", "script: train.py")
                    .replace("args: [--epochs, 2, --out, runs/own-script]",
                             "args: [--epochs, 1, --samples, 1024, --out, /workspace/out]")
                    + "volumes: [{name: out, claim: out, mount: /workspace/out}]\n")
    result = ddpkit("run", str(path), "--docker", "--flavor", flavor, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    lines = re.findall(r"rank (\d)/4 on (\S+): params sha256 ([0-9a-f]{64})", result.stdout)
    assert sorted(int(r) for r, _, _ in lines) == [0, 1, 2, 3], result.stdout[-3000:]
    assert len({h for _, h, _ in lines}) == 2  # two containers
    assert len({s for _, _, s in lines}) == 1  # identical on every rank
    out = tmp_path / "runs" / f"{name}-docker-{flavor}" / "volumes" / "claim-out"
    assert {p.read_text().strip() for p in out.glob("params-rank*.sha256")} == {lines[0][2]}
    assert len(list(out.glob("params-rank*.sha256"))) == 4
    assert "[node 1] " in result.stdout and "train.py --epochs 1" in result.stdout + result.stderr
    assert leftovers(name) == ("", "")


def test_the_image_has_the_rdma_verbs_library_and_asks_for_the_gpus(image):
    """NCCL between nodes needs libibverbs (else TCP sockets, said only at NCCL_DEBUG=INFO);
    the NVIDIA runtime and enroot inject the driver only into an image that asks for it."""
    libs = docker("run", "--rm", "--entrypoint", "ldconfig", image, "-p")
    assert libs.returncode == 0 and "libibverbs.so.1" in libs.stdout, libs.stderr[-1000:]
    config = json.loads(docker("image", "inspect", image, "--format", "{{json .Config.Env}}").stdout)
    assert "NVIDIA_VISIBLE_DEVICES=all" in config and "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in config
