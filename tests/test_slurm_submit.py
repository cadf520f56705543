"""`deploy.slurm.submit` against a recorded stand-in for the Slurm commands (unit tests; the real
cluster is in tests/test_slurm_e2e.py)."""

from __future__ import annotations

import io
import subprocess

import pytest
import yaml

from deploy.errors import RuntimeFailure, UserError
from deploy.load import parse_job
from deploy.slurm import submit as slurm
from deploy.slurm.render import render_slurm
from tests.conftest import ddpkit

JOB = parse_job(yaml.safe_load("""
name: demo
image: x:1
nodes: 2
procs_per_node: 2
"""))


class FakeSlurm:
    """Answers Slurm commands from a table {argv[0]: (rc, stdout, stderr)}; records every call."""

    def __init__(self, **answers):
        self.answers = answers
        self.calls: list[tuple[list[str], str | None]] = []

    def __call__(self, argv, input=None, **kwargs):
        self.calls.append((argv, input))
        answer = self.answers[argv[0]]
        if callable(answer):
            answer = answer(argv)
        rc, out, err = answer
        return subprocess.CompletedProcess(argv, rc, out, err)


def scontrol_line(state: str, restarts: int = 0, stdout: str = "/w/logs/demo-12.out") -> str:
    return (f"JobId=12 JobName=demo UserId=root(0) JobState={state} Reason=None Dependency=(null) "
            f"Requeue=1 Restarts={restarts} BatchFlag=1 Command=(null) WorkDir=/w "
            f"StdErr={stdout} StdIn=/dev/null StdOut={stdout} Power=\n")


def test_submit_pipes_the_rendered_script_into_sbatch_parsable(tmp_path):
    fake = FakeSlurm(sbatch=(0, "12;cluster\n", ""))
    handle = slurm.submit(JOB, source="job.yaml", runner=fake, cwd=tmp_path)
    assert handle == "slurm://12"
    argv, script = fake.calls[0]
    assert argv[:2] == ["sbatch", "--parsable"] and f"--chdir={tmp_path}" in argv
    assert script == render_slurm(JOB, source="job.yaml")
    assert (tmp_path / "logs").is_dir()  # Slurm does not create it


def test_a_refused_submission_is_one_clear_line(tmp_path):
    err = "sbatch: error: Batch job submission failed: Invalid partition name specified\n"
    fake = FakeSlurm(sbatch=(1, "", err))
    with pytest.raises(RuntimeFailure, match="^sbatch refused the job: sbatch: error: Batch job "
                                             "submission failed: Invalid partition name specified$"):
        slurm.submit(JOB, runner=fake, cwd=tmp_path)


def test_missing_slurm_commands_are_one_line(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: demo\nimage: x:1\n")
    proc = ddpkit("submit", "slurm", str(job), env={"PATH": str(tmp_path)}, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("error: sbatch not found") and proc.stderr.count("\n") == 1
    proc = ddpkit("status", "slurm://5", env={"PATH": str(tmp_path)})
    assert proc.returncode == 1 and "scontrol not found" in proc.stderr


@pytest.mark.parametrize("state,restarts,shared", [
    ("PENDING", 0, "PENDING"), ("PENDING", 1, "RESTARTING"), ("RUNNING", 0, "RUNNING"),
    ("COMPLETING", 0, "RUNNING"), ("REQUEUED", 1, "RESTARTING"), ("COMPLETED", 1, "SUCCEEDED"),
    ("FAILED", 0, "FAILED"), ("TIMEOUT", 0, "FAILED"), ("OUT_OF_MEMORY", 0, "FAILED"),
    ("CANCELLED", 0, "CANCELLED"),
])
def test_status_speaks_the_shared_vocabulary(state, restarts, shared):
    fake = FakeSlurm(scontrol=(0, scontrol_line(state, restarts), ""))
    assert slurm.status("slurm://12", runner=fake) == shared
    assert fake.calls[0][0] == ["scontrol", "show", "job", "-o", "12"]


@pytest.mark.parametrize("fields,line", [
    # what real slurmctld 22.05 showed on the testbed after a node's slurmd was killed
    ("JobState=NODE_FAIL Reason=NodeDown Requeue=0 Restarts=0",
     "FAILED (NODE_FAIL: a node of the job stopped responding (Slurm marked it DOWN); "
     "not requeued: the job is not requeueable (restarts: 0))"),
    ("JobState=PENDING Reason=Nodes_required_for_job_are_DOWN,_DRAINED Requeue=1 Restarts=1",
     "RESTARTING (Slurm reason: Nodes_required_for_job_are_DOWN,_DRAINED; restart 1)"),
    ("JobState=COMPLETED Reason=None Requeue=1 Restarts=1", "SUCCEEDED"),
])
def test_status_line_says_why_slurm_ended_or_holds_a_job(fields, line):
    fake = FakeSlurm(scontrol=(0, f"JobId=12 JobName=demo {fields} BatchFlag=1 WorkDir=/w\n", ""))
    assert slurm.describe("slurm://12", runner=fake) == line
    assert slurm.status("slurm://12", runner=fake) == line.split()[0]


def test_status_falls_back_to_sacct_when_slurmctld_forgot_the_job():
    fake = FakeSlurm(scontrol=(1, "", "slurm_load_jobs error: Invalid job id specified\n"),
                     sacct=(0, "COMPLETED\n", ""))
    assert slurm.status("slurm://12", runner=fake) == "SUCCEEDED"
    fake = FakeSlurm(scontrol=(1, "", "slurm_load_jobs error: Invalid job id specified\n"),
                     sacct=(1, "", "Slurm accounting storage is disabled\n"))
    with pytest.raises(RuntimeFailure, match="no longer knows job 12"):
        slurm.status("slurm://12", runner=fake)


def test_handles_are_checked():
    with pytest.raises(UserError, match="slurm://JOBID"):
        slurm.job_id("slurm://12; rm -rf /")
    assert slurm.job_id("slurm://12") == "12" and slurm.job_id("34_2") == "34_2"


def test_logs_print_the_output_file_slurm_names(tmp_path):
    log = tmp_path / "demo-12.out"
    log.write_text("ddpkit: demo starting\n[rank0]: step 10 loss 2.0\n[rank1]: step 10 loss 2.1\n")
    fake = FakeSlurm(scontrol=(0, scontrol_line("COMPLETED", stdout=str(log)), ""))
    out = io.StringIO()
    assert slurm.logs("slurm://12", runner=fake, out=out) == 0
    assert out.getvalue() == log.read_text()
    out = io.StringIO()
    slurm.logs("slurm://12", rank=1, runner=fake, out=out)
    assert out.getvalue() == "ddpkit: demo starting\n[rank1]: step 10 loss 2.1\n"


def test_logs_follow_until_the_job_ends(tmp_path):
    log = tmp_path / "demo-12.out"
    log.write_text("first\n")
    states = iter(["RUNNING", "RUNNING", "COMPLETED", "COMPLETED", "COMPLETED"])

    def scontrol(argv):
        state = next(states)
        if state == "COMPLETED":
            with log.open("a") as fh:
                fh.write("last\n")
        return 0, scontrol_line(state, stdout=str(log)), ""

    out = io.StringIO()
    slurm.logs("slurm://12", follow=True, runner=FakeSlurm(scontrol=scontrol), out=out, poll_s=0.01)
    assert out.getvalue() == "first\nlast\n"


def test_cancel_runs_scancel_and_waits_for_the_end():
    states = iter(["RUNNING", "CANCELLED"])
    fake = FakeSlurm(scancel=(0, "", ""),
                     scontrol=lambda argv: (0, scontrol_line(next(states)), ""))
    slurm.cancel("slurm://12", runner=fake)
    assert fake.calls[0][0] == ["scancel", "12"]
    fake = FakeSlurm(scancel=(1, "", "scancel: error: Kill job error on job id 12: Invalid job id specified\n"))
    with pytest.raises(RuntimeFailure, match="^scancel 12 failed: .*Invalid job id"):
        slurm.cancel("slurm://12", runner=fake)


def test_submitit_launch_sets_the_same_contract(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    launch = slurm.SlurmLaunch(JOB.to_yaml(), "demo", "logs", 2, 1, "torchrun", None)
    env = launch.environment({"SLURM_JOB_NODELIST": "node[07-08]", "SLURM_JOB_ID": "4242",
                              "SLURM_JOB_NUM_NODES": "2"})
    assert env["DDPKIT_MASTER_ADDR"] == "node07" and env["DDPKIT_MASTER_PORT"] == "19242"
    assert env["DDPKIT_JOB_FILE"] == str(tmp_path / "logs" / "demo-4242.job.yaml")
    assert env["DDPKIT_NPROC_PER_NODE"] == "2" and env["DDPKIT_LAUNCHER"] == "torchrun"


def test_submitit_gets_the_sbatch_scripts_resources(tmp_path, monkeypatch):
    """`--via submitit` asks for what the #SBATCH lines ask for (same helpers, same rounding);
    submitit itself is a recording stand-in here, the real one runs in the e2e tests."""
    import sys
    import types

    recorded: dict = {}

    class Executor:
        def __init__(self, **kwargs):
            recorded["executor"] = kwargs

        def update_parameters(self, **params):
            recorded["params"] = params

        def submit(self, fn):
            recorded["fn"] = fn
            return types.SimpleNamespace(job_id="77")

    monkeypatch.setitem(sys.modules, "submitit", types.SimpleNamespace(SlurmExecutor=Executor))
    monkeypatch.setattr(slurm.shutil, "which", lambda cmd: f"/usr/bin/{cmd}")
    job = parse_job(yaml.safe_load("""
name: demo
image: x:1
nodes: 2
gpus_per_node: 4
resources: {cpus_per_node: 8, memory: 3000000000, shm: 64Mi}
time_limit: 3m
"""), overrides=["slurm.launcher=srun", "slurm.gpu_flag=gres", "slurm.partition=gpu"])
    assert slurm.submit(job, via="submitit", cwd=tmp_path) == "slurm://77"
    params = recorded["params"]
    assert params["ntasks_per_node"] == 4 and params["cpus_per_task"] == 2
    assert params["gres"] == "gpu:4" and "gpus_per_node" not in params
    assert params["mem"] == "2862M" and params["time"] == 3 and params["partition"] == "gpu"
    sbatch = directives_of(render_slurm(job))
    for flag in ("--ntasks-per-node=4", "--cpus-per-task=2", "--gres=gpu:4", "--mem=2862M",
                 "--time=0-00:03:00"):
        assert flag in sbatch, flag
    job = parse_job(yaml.safe_load("{name: demo, image: x:1, gpus_per_node: 2}"))
    slurm.submit(job, via="submitit", cwd=tmp_path)
    assert recorded["params"]["gpus_per_node"] == 2 and "gres" not in recorded["params"]
    # a GPU job that does not say gets CPUS_PER_GPU per GPU, on both paths (not Slurm's 1)
    assert "mem" not in recorded["params"] and recorded["params"]["cpus_per_task"] == 8
    assert "--cpus-per-task=8" in recorded["params"]["srun_args"]
    assert "--cpus-per-task=8" in directives_of(render_slurm(job))


def directives_of(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_a_missing_secret_is_reported_before_sbatch(tmp_path, monkeypatch):
    job = parse_job(yaml.safe_load("""
name: demo
image: x:1
secret_env: [{name: API_TOKEN, secret: api, key: token}]
"""))
    fake = FakeSlurm(sbatch=(0, "123\n", ""))
    monkeypatch.delenv("API_TOKEN", raising=False)
    with pytest.raises(UserError) as err:
        slurm.submit(job, runner=fake, cwd=tmp_path)
    assert err.value.problems == [
        "job.yaml: secret_env.0.name: API_TOKEN is not set in this environment, and on Slurm the "
        "job gets it only from there (Kubernetes Secret api/token does not exist on Slurm); "
        "export API_TOKEN before `ddpkit submit slurm`"]
    assert fake.calls == []  # nothing reached Slurm
    monkeypatch.setenv("API_TOKEN", "s3cret")
    assert slurm.submit(job, runner=fake, cwd=tmp_path) == "slurm://123"


def _recording_submitit(monkeypatch) -> dict:
    import sys
    import types

    recorded: dict = {}

    class Executor:
        def __init__(self, **kwargs):
            recorded["executor"] = kwargs

        def update_parameters(self, **params):
            recorded["params"] = params

        def submit(self, fn):
            recorded["fn"] = fn
            return types.SimpleNamespace(job_id="78")

    monkeypatch.setitem(sys.modules, "submitit", types.SimpleNamespace(SlurmExecutor=Executor))
    monkeypatch.setattr(slurm.shutil, "which", lambda cmd: f"/usr/bin/{cmd}")
    return recorded


def test_submitit_honours_directives_elastic_nodes_apptainer_conda_and_secrets(tmp_path, monkeypatch):
    recorded = _recording_submitit(monkeypatch)
    monkeypatch.setenv("API_TOKEN", "s3cret")
    job = parse_job(yaml.safe_load("""
name: demo
image: ghcr.io/org/t:1
nodes: "2:4"
gpus_per_node: 2
gpu_resource: amd.com/gpu
env: {NCCL_DEBUG: WARN}
secret_env: [{name: API_TOKEN, secret: api, key: token}]
volumes: [{name: d, host_path: /lustre/d, mount: /data, read_only: true}]
slurm:
  container: apptainer
  modules: [rocm/6.0]
  setup: ["echo hello"]
  extra_directives: [--mail-type=END, --hint=nomultithread]
"""))
    assert slurm.submit(job, via="submitit", cwd=tmp_path) == "slurm://78"
    params = recorded["params"]
    assert params["additional_parameters"] == {"mail-type": "END", "hint": "nomultithread",
                                               "nodes": "2-4", "chdir": str(tmp_path)}
    assert params["setup"] == [
        "set +u", "module load rocm/6.0", "echo hello", "export NCCL_DEBUG=WARN",
        ': "${API_TOKEN:?secret_env API_TOKEN is not set: export it before submitting}"',
        "export API_TOKEN"]
    assert params["srun_args"] == ["--kill-on-bad-exit=1", "--cpus-per-task=8"]
    assert recorded["fn"].container == ["apptainer", "exec", "--rocm", "--bind", "/lustre/d:/data:ro",
                                        "docker://ghcr.io/org/t:1"]
    env = recorded["fn"].environment({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "5",
                                      "SLURM_JOB_NUM_NODES": "2"})
    assert env["DDPKIT_STOP_GRACE_S"] == "120"  # the signal's lead, as the script exports it
    # the same #SBATCH options as the script
    sbatch = directives_of(render_slurm(job))
    assert "--mail-type=END" in sbatch and "--nodes=2-4" in sbatch
    # a conda prefix without bin/activate, as in the script
    job = parse_job(yaml.safe_load("{name: demo, image: x:1, slurm: {venv: /opt/conda/envs/t}}"))
    slurm.submit(job, via="submitit", cwd=tmp_path)
    [venv] = [line for line in recorded["params"]["setup"] if "/opt/conda/envs/t" in line]
    proc = subprocess.run(["bash", "-c", venv + '; echo "$CONDA_PREFIX $PATH"'], capture_output=True, text=True)
    assert proc.stdout.startswith("/opt/conda/envs/t /opt/conda/envs/t/bin:"), proc.stdout + proc.stderr


@pytest.mark.parametrize("patch,expected", [
    ({"slurm": {"container": "pyxis"}}, "slurm.container: pyxis puts submitit's own srun step in the container"),
    ({"slurm": {"signal": "TERM"}}, "slurm.signal: TERM: submitit always asks Slurm for SIGUSR2"),
    ({"restarts": 1, "slurm": {"launcher": "srun"}}, "restarts: 1 in srun mode"),
])
def test_submitit_refuses_what_it_cannot_do_like_the_script(tmp_path, monkeypatch, patch, expected):
    recorded = _recording_submitit(monkeypatch)
    job = parse_job({"name": "demo", "image": "x:1", **patch})
    with pytest.raises(UserError) as err:
        slurm.submit(job, via="submitit", cwd=tmp_path)
    assert any(expected in p for p in err.value.problems), err.value.problems
    assert "fn" not in recorded
