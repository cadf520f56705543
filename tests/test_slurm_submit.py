"""`deploy.slurm.submit` against a recorded stand-in for the Slurm commands (unit tests; the real
cluster is in tests/test_slurm_e2e.py). `--via submitit` runs the real submitit, with stand-in
`sbatch` and `srun` commands only, and its own sbatch text is compared with ddpkit's script."""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy.errors import RuntimeFailure, UserError
from deploy.load import parse_job
from deploy.logs import Query
from deploy.slurm import submit as slurm
from deploy.slurm.directives import parse as parse_directive
from deploy.slurm.directives import restarts_in_allocation
from deploy.slurm.render import render_slurm
from deploy.slurm.submitit import SlurmLaunch
from deploy.why import state_cause
from tests.conftest import ddpkit
from trainer.contract import slurm_port

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
    ("PREEMPTED", 0, "FAILED"), ("PREEMPTED", 1, "FAILED"),  # a requeue shows REQUEUED, PENDING
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
    # preempted and not requeued (PreemptMode=CANCEL, or not requeueable): over, not RESTARTING
    ("JobState=PREEMPTED Reason=None Requeue=0 Restarts=0",
     "FAILED (PREEMPTED: preempted, and Slurm does not requeue it (not requeueable, or "
     "PreemptMode=CANCEL): submit it again to resume from the checkpoint)"),
])
def test_status_line_says_why_slurm_ended_or_holds_a_job(fields, line):
    fake = FakeSlurm(scontrol=(0, f"JobId=12 JobName=demo {fields} BatchFlag=1 WorkDir=/w\n", ""))
    assert slurm.describe("slurm://12", runner=fake) == line
    assert slurm.status("slurm://12", runner=fake) == line.split()[0]


FORGOT = (1, "", "slurm_load_jobs error: Invalid job id specified\n")
SACCT_RECORDED = Path(__file__).parent / "recorded" / "slurm"
#: what each recorded job is (the file name's last word): Slurm's state word and why's category;
#: a `failed` job's script exited 1 (`sbatch --wrap 'exit 1'`)
RECORDED_AS = {"failed": ("FAILED", "exception"), "timeout": ("TIMEOUT", "time-limit"),
               "cancelled": ("CANCELLED", "cancelled"), "node_fail": ("NODE_FAIL", "node-lost"),
               "oom": ("OUT_OF_MEMORY", "oom"), "preempted": ("PREEMPTED", "preempted")}


def sacct_answers(json_answer, parsable=(1, "", "")):
    """A sacct that answers `--json` with json_answer and `-P` with parsable."""
    return lambda argv: json_answer if "--json" in argv else parsable


#: The releases with recorded answers (22.05's is not recorded yet: the testbed keeps no
#: accounting; tests/recorded/slurm/README.md says how to record it).
RECORDED_RELEASES = sorted({p.stem.split("-")[1] for p in SACCT_RECORDED.glob("*-*-*.json")})


@pytest.mark.parametrize("release", RECORDED_RELEASES)
def test_sacct_json_of_each_release_says_why_a_forgotten_job_ended(release):
    """Every recorded `sacct --json` job of the release (tests/recorded/slurm/README.md) through
    the reader, `ddpkit status`'s line and `why`'s category."""
    files = sorted(SACCT_RECORDED.glob(f"*-{release}-*.json"))
    assert files
    for path in files:
        word, category = RECORDED_AS[path.stem.rsplit("-", 1)[1]]
        job = json.loads(path.read_text())["jobs"][0]
        fake = FakeSlurm(scontrol=FORGOT, sacct=sacct_answers((0, path.read_text(), "")))
        handle = f"slurm://{job['job_id']}"
        ended = slurm.accounted(handle, runner=fake)
        line = slurm.describe(handle, runner=fake)
        assert ended.state == word and ended.nodes and ended.nodes in line, (path.name, ended)
        assert line.split()[0] == slurm.STATES[word] == slurm.status(handle, runner=fake), line
        assert state_cause(line).category == category, (path.name, line)
        assert slurm.why(handle, runner=fake)[0].startswith(f"{category}: "), path.name
        if word == "CANCELLED":
            assert ended.cancelled_by and f"cancelled by {ended.cancelled_by}" in line, line
        if word == "TIMEOUT":
            assert ended.elapsed_s >= ended.limit_s and f"of its {ended.limit_s} s limit" in line, line
        if word == "FAILED":
            assert ended.exit_code == 1 and "exit code 1" in line, line
        assert fake.calls[0][0] == ["sacct", "--json", "-j", str(job["job_id"])]  # accounted() first


def test_without_sacct_json_the_parsable_form_is_read():
    """A sacct without --json: `-P` with the fields why needs. Not a recording: the format of
    `sacct -P` (fields joined by |, `N:S` exit codes, `CANCELLED by UID`) as sacct(1) gives it."""
    no_json = (1, "", "sacct: unrecognized option '--json'\n")
    lines = ("12|CANCELLED by 1000|None|0:15|node[1-2]|61|10\n12.batch|CANCELLED|None|0:15|node1|61|\n")
    fake = FakeSlurm(scontrol=FORGOT, sacct=sacct_answers(no_json, (0, lines, "")))
    assert slurm.describe("slurm://12", runner=fake) == "CANCELLED (cancelled by uid 1000; nodes: node[1-2])"
    assert fake.calls[-1][0][:5] == ["sacct", "-n", "-P", "-o", "JobID,State,Reason,ExitCode,NodeList,ElapsedRaw,TimelimitRaw"]
    killed = "12|FAILED|None|0:9|node1|5|10\n"
    fake = FakeSlurm(scontrol=FORGOT, sacct=sacct_answers(no_json, (0, killed, "")))
    assert slurm.describe("slurm://12", runner=fake) == "FAILED (killed by signal 9 (SIGKILL); nodes: node1)"
    assert slurm.why("slurm://12", runner=fake)[0].startswith("killed: ")


def test_a_job_accounting_does_not_know_is_one_clear_line():
    disabled = (1, "", "Slurm accounting storage is disabled\n")
    fake = FakeSlurm(scontrol=FORGOT, sacct=disabled)
    with pytest.raises(RuntimeFailure, match="^Slurm no longer knows job 12 and accounting has no record "
                                             "of it \\(sacct: Slurm accounting storage is disabled\\)"):
        slurm.status("slurm://12", runner=fake)
    empty = (0, json.dumps({"jobs": [], "errors": [], "warnings": []}), "")
    with pytest.raises(RuntimeFailure, match="no longer knows job 12 and accounting has no record of it:"):
        slurm.describe("slurm://12", runner=FakeSlurm(scontrol=FORGOT, sacct=empty))


def test_handles_are_checked():
    with pytest.raises(UserError, match="slurm://JOBID"):
        slurm.job_id("slurm://12; rm -rf /")
    assert slurm.job_id("slurm://12") == "12" and slurm.job_id("34_2") == "34_2"


# A job's output file, two nodes x two processes, torchrun mode: the batch shell's lines (no
# tag), then each node's as `trainer.launch` tags them. Node 0's lines are as a real launch
# wrote them (tests/test_launch.py, slurm context, shortened); node 1's the same kinds.
SUMMARY = '{"summary": true, "status": "completed", "world_size": 4, "x": "' + "a" * 9000 + '"}'
TAGGED_LOG = (
    "ddpkit: demo (job 12, restart 0) on 2 nodes\n"
    "[0/-] ddpkit launch: context slurm, node rank 0, mode torchrun: -m torch.distributed.run --nnodes 2\n"
    "[1/-] ddpkit launch: context slurm, node rank 1, mode torchrun: -m torch.distributed.run --nnodes 2\n"
    "[0/0] 04:30:28 ddpkit rank 0 INFO step 1/3 epoch 0 loss 2.3046 lr 0.01 299 samples/s\n"
    "[1/3] [rank3]: RuntimeError: boom\n"
    "[1/2] 04:30:28 ddpkit rank 2 WARNING slow\n"
    "[0/-] ddpkit-summary " + SUMMARY + "\n"
    "ddpkit: job step exited with code 0\n")


def shown(*picked: int, tags: bool = False) -> str:
    lines = TAGGED_LOG.splitlines(keepends=True)
    return "".join(lines[i] if tags else re.sub(r"^\[\d+/[\d-]+\] ", "", lines[i]) for i in picked)


@pytest.mark.parametrize("query,expected", [
    (Query(), shown(0, 1, 3, 6, 7)),  # node 0, as on Kubernetes (its pod); the shell's lines
    (Query(rank=1), shown(0, 2, 4, 5, 7)),
    (Query(worker_rank=3), shown(0, 4, 7)),  # global rank 3: the lines it is tagged with
    (Query(every=True), TAGGED_LOG),  # every node, each line's [NODE/RANK] kept
    (Query(every=True, grep=r"rank \d WARN|boom"), shown(4, 5, tags=True)),
    (Query(rank=0, grep="^ddpkit-summary"), shown(6)),  # the grep sees the line as printed
])
def test_logs_rank_is_a_node_worker_rank_a_process_all_every_line(tmp_path, query, expected):
    log = tmp_path / "demo-12.out"
    log.write_text(TAGGED_LOG)
    fake = FakeSlurm(scontrol=(0, scontrol_line("COMPLETED", stdout=str(log)), ""))
    out = io.StringIO()
    assert slurm.logs("slurm://12", query=query, runner=fake, out=out) == 0
    assert out.getvalue() == expected
    if "ddpkit-summary" in expected:  # whole after the tag is gone
        assert json.loads(expected.split("ddpkit-summary ", 1)[1].splitlines()[0]) == json.loads(SUMMARY)


def test_logs_of_a_job_from_before_the_tags_print_every_line(tmp_path):
    log = tmp_path / "demo-12.out"
    log.write_text("ddpkit: demo starting\n[rank0]: step 10 loss 2.0\n[rank1]: step 10 loss 2.1\n")
    fake = FakeSlurm(scontrol=(0, scontrol_line("COMPLETED", stdout=str(log)), ""))
    out = io.StringIO()
    slurm.logs("slurm://12", rank=1, runner=fake, out=out)
    assert out.getvalue() == log.read_text()


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


# ---------------------------------------------------------------------------------------------
# --via submitit: the real submitit writes its sbatch script; only `sbatch` and `srun` are stand-ins

FAKE_SBATCH = """#!/bin/sh
echo "$@" >> "$FAKE_DIR/sbatch.calls"
echo "Submitted batch job 77"
"""


@pytest.fixture
def fake_sbatch(tmp_path_factory, monkeypatch):
    """`sbatch` that accepts every script as job 77 and records its arguments; `srun` exists
    (submitit's SlurmExecutor looks for it). Returns the directory of the calls file."""
    import submitit

    fake_dir = tmp_path_factory.mktemp("fake-slurm")
    for name, text in (("sbatch", FAKE_SBATCH), ("srun", "#!/bin/sh\nexit 0\n")):
        (fake_dir / name).write_text(text)
        (fake_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DIR", str(fake_dir))
    yield fake_dir
    submitit.SlurmJob.watcher.clear()  # as submitit's own tests do (a shared watcher)


def submit_via_submitit(job, workdir: Path) -> tuple[str, SlurmLaunch]:
    """`submit --via submitit`: the sbatch text submitit wrote and the launch it pickled."""
    from submitit.core.utils import DelayedSubmission

    assert slurm.submit(job, via="submitit", cwd=workdir) == "slurm://77"
    folder = workdir / job.slurm.log_dir / "submitit"
    launch = DelayedSubmission.load(folder / "77_submitted.pkl").function
    assert isinstance(launch, SlurmLaunch)
    return (folder / "77_submission.sh").read_text(), launch


def sbatch_options(script: str) -> dict[str, str | bool]:
    """The #SBATCH options of a script as {name: value or True} (submitit shell-quotes values)."""
    options: dict[str, str | bool] = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            [word] = shlex.split(line.removeprefix("#SBATCH "))
            name, value = parse_directive(word)
            assert name not in options, f"--{name} twice"
            options[name] = value if value is True else str(value)
    return options


def minutes(value: str) -> int:
    """A Slurm --time value (minutes, or D-HH:MM:SS) in minutes."""
    if value.isdigit():
        return int(value)
    days, clock = value.split("-")
    hours, mins, secs = clock.split(":")
    assert secs == "00"
    return int(days) * 1440 + int(hours) * 60 + int(mins)


def lines_after(script: str, start: str, end: str = "") -> list[str]:
    """The lines after the first line `start`, up to the next line `end`."""
    lines = script.splitlines()
    if start not in lines:
        return []
    rest = lines[lines.index(start) + 1:]
    return rest[:rest.index(end)]


def assert_same_request(job, workdir: Path) -> tuple[str, str, SlurmLaunch]:
    """ddpkit's sbatch script and the one submitit wrote ask Slurm for the same job: the same
    #SBATCH options but where submitit has its own way, the same setup lines, the same srun
    options, the same container and argv, the same launch contract."""
    script = render_slurm(job)
    text, launch = submit_via_submitit(job, workdir)
    ours, theirs = sbatch_options(script), sbatch_options(text)
    # where the two legitimately differ:
    # - submitit writes its own log files (srun writes each task's) in its folder
    for name in ("output", "error"):
        assert ours.pop(name) == f"{job.slurm.log_dir}/%x-%j.out"
        assert theirs.pop(name).startswith(f"{workdir / job.slurm.log_dir / 'submitit'}/%j_0_log.")
    # - submitit signals every task itself (its USR2 handler, SlurmLaunch forwards it), not the
    #   batch shell (`B:`, whose trap in ddpkit's script forwards it), and always: same lead
    signal = ours.pop("signal", None)
    assert theirs.pop("signal") == f"USR2@{job.slurm.signal_seconds}"
    assert signal in (None, f"B:USR2@{job.slurm.signal_seconds}")
    # - submitit's time is whole minutes; ddpkit's D-HH:MM:SS is rounded up to whole minutes
    assert minutes(ours.pop("time")) == minutes(theirs.pop("time")) == -(-job.time_limit // 60)
    # - submitit tags its jobs; `submit` gives sbatch the submit directory on its command line
    assert theirs.pop("wckey") == "submitit"
    assert theirs.pop("chdir") == str(workdir)
    # - ddpkit's script restarts an elastic job's step inside the allocation (--no-kill, a step
    #   per attempt on the nodes that answer: torchrun restarts nothing, the step's node count
    #   is set per step); submitit's is requeued by Slurm
    in_allocation = restarts_in_allocation(job)
    assert ours.pop("no-kill", None) == (True if in_allocation else None)
    assert ours == theirs
    # setup: ddpkit's setup block (modules, slurm.setup, venv) then its exports (env:, secrets)
    setup = lines_after(script, "set +u", "set -u")
    exports = lines_after(script, "# Environment of every process (env:).")
    assert lines_after(text, "# setup") == setup + exports
    # the job step: the same srun options (ddpkit's also names the node count, for an elastic job)
    [srun] = [line for line in text.splitlines() if line.startswith("srun ")]
    words = shlex.split(srun)
    assert words[:6] == ["srun", "--unbuffered", "--output", words[3], "--error", words[5]]
    step = list(itertools.takewhile(lambda w: w.startswith("--"), words[6:]))
    launch_words = script_launch(script)
    nodes = (["--nodes=$step_nnodes", "--nodelist=$step_nodes", "--ntasks=$step_ntasks", "--overlap"]
             if in_allocation
             else ["--nodes=$SLURM_JOB_NUM_NODES"])
    assert launch_words[:len(nodes) + 1] == ["srun", *nodes]
    launch_words = ["srun", *launch_words[len(nodes) + 1:]]
    assert launch_words[1:1 + len(step)] == step
    # what each task runs: the container prefix and argv (the script's, with its $job_dir
    # resolved; without a container the entry point runs in submitit's interpreter)
    argv = [launch.job_dir() if w == "$job_dir" else w for w in launch_words[1 + len(step):]]
    if job.slurm.container == "none" and not job.command:
        assert argv == ["python", "-m", "trainer.launch"]
        argv = [sys.executable, *argv[1:]]
    assert launch.argv() == argv
    # the launch contract: what the script exports as literals, SlurmLaunch sets the same
    env = launch.environment({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "4242",
                              "SLURM_JOB_NUM_NODES": "2"})
    exported = dict(re.findall(r"^export (DDPKIT_\w+)=(\w[^\s]*)$", script, re.M))
    if in_allocation:  # the batch shell restarts the step; torchrun restarts nothing
        assert exported.pop("DDPKIT_MAX_RESTARTS") == "0"
    assert exported and {k: env[k] for k in exported} == exported
    assert env["DDPKIT_MASTER_PORT"] == str(slurm_port(4242)) and env["DDPKIT_MASTER_ADDR"] == "n1"
    assert env["DDPKIT_NNODES"] == "2"
    assert env["DDPKIT_JOB_FILE"] == f"{launch.job_dir()}/{job.name}-4242.job.yaml"
    return script, text, launch


def script_launch(script: str) -> list[str]:
    """The words of the script's job step, `srun ...` to the entry point (not the step of the
    allocation's resident templates, which restarts inside the allocation also start)."""
    lines = script.splitlines()
    commands = []
    for start in (i for i, line in enumerate(lines) if line.strip().startswith("srun --nodes=")):
        command = lines[start].strip()
        while command.endswith(" \\"):
            start += 1
            command = command[:-2] + " " + lines[start].strip()
        commands.append(shlex.split(command.removesuffix(" &").removesuffix(" || rc=$?")))
    [step] = [words for words in commands if "--resident" not in words]
    return step


def test_submitit_gets_the_sbatch_scripts_resources(tmp_path, fake_sbatch, monkeypatch):
    """`--via submitit` asks for what the #SBATCH lines ask for: the real submitit's sbatch
    text against ddpkit's script, for srun mode with typed resources and for a GPU job that
    says nothing about CPUs (CPUS_PER_GPU per GPU on both paths, not Slurm's 1)."""
    monkeypatch.chdir(tmp_path)
    job = parse_job(yaml.safe_load("""
name: demo
image: x:1
nodes: 2
gpus_per_node: 4
resources: {cpus_per_node: 8, memory: 3000000000, shm: 64Mi}
time_limit: 3m
"""), overrides=["slurm.launcher=srun", "slurm.gpu_flag=gres", "slurm.partition=gpu"])
    _, text, _ = assert_same_request(job, tmp_path)
    options = sbatch_options(text)
    assert options["ntasks-per-node"] == "4" and options["cpus-per-task"] == "2"
    assert options["gres"] == "gpu:4" and "gpus-per-node" not in options
    assert options["mem"] == "2862M" and options["time"] == "3" and options["partition"] == "gpu"
    assert options["no-requeue"] is True  # restarts: 0, as the script says
    job = parse_job(yaml.safe_load("{name: demo, image: x:1, gpus_per_node: 2, time_limit: 1h}"))
    _, text, _ = assert_same_request(job, tmp_path)
    options = sbatch_options(text)
    assert options["gpus-per-node"] == "2" and "gres" not in options and "mem" not in options
    assert options["cpus-per-task"] == "8" and " --cpus-per-task=8 " in text


def test_submitit_honours_directives_elastic_nodes_apptainer_conda_and_secrets(tmp_path, fake_sbatch,
                                                                               monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("API_TOKEN", "s3cret")
    job = parse_job(yaml.safe_load("""
name: demo
image: registry.example/org/t:1
nodes: "2:4"
gpus_per_node: 2
gpu_resource: amd.com/gpu
time_limit: 2h
env: {NCCL_DEBUG: WARN}
secret_env: [{name: API_TOKEN, secret: api, key: token}]
volumes: [{name: d, host_path: /lustre/d, mount: /data, read_only: true}]
slurm:
  container: apptainer
  modules: [rocm/6.0]
  setup: ["echo hello"]
  extra_directives: [--mail-type=END, --hint=nomultithread]
"""))
    _, text, launch = assert_same_request(job, tmp_path)
    lines = text.splitlines()
    assert [x for x in lines if x.startswith("#SBATCH --nodes")] == ["#SBATCH --nodes=2-4"]
    assert "#SBATCH --mail-type=END" in lines and "#SBATCH --hint=nomultithread" in lines
    assert lines_after(text, "# setup") == [
        "module load rocm/6.0", "echo hello", "export NCCL_DEBUG=WARN",
        "# secret_env API_TOKEN: never written here; export it before calling sbatch.",
        ': "${API_TOKEN:?secret_env API_TOKEN is not set: export it before sbatch (Kubernetes '
        'Secret api/token does not exist on Slurm)}"',
        "export API_TOKEN"]
    assert launch.argv() == ["apptainer", "exec", "--rocm", "--bind", "/lustre/d:/data:ro",
                             "docker://registry.example/org/t:1", "python", "-m", "trainer.launch"]
    env = launch.environment({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "5",
                              "SLURM_JOB_NUM_NODES": "2"})
    assert env["DDPKIT_STOP_GRACE_S"] == "120"  # the signal's lead, as the script exports it
    assert env["DDPKIT_JOB_FILE"] == str(tmp_path / "logs" / "demo-5.job.yaml")
    # a conda prefix without bin/activate, as in the script: submitit's own setup lines, run
    job = parse_job(yaml.safe_load("{name: demo, image: x:1, time_limit: 1h, slurm: {venv: /opt/conda/envs/t}}"))
    _, text, _ = assert_same_request(job, tmp_path)
    setup = "\n".join(lines_after(text, "# setup"))
    proc = subprocess.run(["bash", "-c", setup + '\necho "$CONDA_PREFIX $PATH"'], capture_output=True, text=True)
    assert proc.stdout.startswith("/opt/conda/envs/t /opt/conda/envs/t/bin:"), proc.stdout + proc.stderr


def test_submitit_binds_an_absolute_log_dir_into_the_container(tmp_path, fake_sbatch, monkeypatch):
    """The job file lies in the log dir; outside the working directory Apptainer must bind it,
    at the path DDPKIT_JOB_FILE names (the script's `$job_dir`, resolved)."""
    monkeypatch.chdir(tmp_path)
    logs = tmp_path / "abs-logs"
    job = parse_job({"name": "demo", "image": "x:1", "time_limit": "1h",
                     "slurm": {"container": "apptainer", "log_dir": str(logs)}})
    _, _, launch = assert_same_request(job, tmp_path)
    assert launch.argv()[:4] == ["apptainer", "exec", "--bind", str(logs)]
    env = launch.environment({"SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "9", "SLURM_JOB_NUM_NODES": "1"})
    assert env["DDPKIT_JOB_FILE"] == str(logs / "demo-9.job.yaml")


@pytest.mark.parametrize("patch,expected", [
    ({"slurm": {"container": "pyxis"}}, "slurm.container: pyxis puts submitit's own srun step in the container"),
    ({"slurm": {"signal": "TERM"}}, "slurm.signal: TERM: submitit always asks Slurm for SIGUSR2"),
    ({"restarts": 1, "slurm": {"launcher": "srun"}}, "restarts: 1 in srun mode"),
    # without a time limit submitit would write --time=5 (minutes): found by comparing the texts
    ({"time_limit": None}, "time_limit: not set, and submitit then asks Slurm for 5 minutes"),
])
def test_submitit_refuses_what_it_cannot_do_like_the_script(tmp_path, fake_sbatch, patch, expected):
    job = parse_job({"name": "demo", "image": "x:1", "time_limit": "1h", **patch})
    with pytest.raises(UserError) as err:
        slurm.submit(job, via="submitit", cwd=tmp_path)
    assert any(expected in p for p in err.value.problems), err.value.problems
    assert not (fake_sbatch / "sbatch.calls").exists()  # nothing reached sbatch
    assert not (tmp_path / "logs" / "submitit").exists()


@given(nodes=st.sampled_from([1, 2, 3, "1:2", "2:4"]), gpus=st.integers(0, 8),
       launcher=st.sampled_from(["torchrun", "srun"]), container=st.sampled_from(["none", "apptainer"]),
       cpus_per_task=st.one_of(st.none(), st.integers(1, 6)), minutes=st.one_of(st.none(), st.integers(3, 4000)),
       restarts=st.integers(0, 2), gpu_flag=st.sampled_from(["gpus-per-node", "gres"]))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_submitit_and_the_script_agree_for_generated_jobs(fake_sbatch, nodes, gpus, launcher, container,
                                                           cpus_per_task, minutes, restarts, gpu_flag):
    procs = gpus or 2
    tasks = 1 if launcher == "torchrun" else procs
    job = parse_job({
        "name": "gen", "image": "registry.example/org/t:1", "nodes": nodes, "gpus_per_node": gpus,
        **({} if gpus else {"procs_per_node": procs}), "restarts": restarts,
        **({"time_limit": f"{minutes}m"} if minutes else {}),
        "resources": {} if cpus_per_task is None else {"cpus_per_node": cpus_per_task * tasks},
        "slurm": {"launcher": launcher, "container": container, "gpu_flag": gpu_flag,
                  "requeue": bool(restarts and launcher == "srun")}})
    if minutes is None:  # submitit would ask for 5 minutes: refused
        with pytest.raises(UserError, match="time_limit: not set"):
            slurm.submit(job, via="submitit", cwd=Path.cwd())
        return
    with tempfile.TemporaryDirectory() as workdir:
        cwd = os.getcwd()
        os.chdir(workdir)
        try:
            assert_same_request(job, Path(workdir).resolve())
        finally:
            os.chdir(cwd)


def test_status_report_reads_the_record_from_the_output_file_and_the_queue_wait(tmp_path):
    """The newest `ddpkit-progress` line at the end of the job's StdOut file (a long log: only
    its tail is read), and StartTime - SubmitTime once the job has started."""
    out = tmp_path / "demo-12.out"
    out.write_text('ddpkit-progress {"step": 1}\n' + "x" * 300_000 + "\n"
                   + '[default0]:ddpkit-progress {"state": "running", "step": 8, "total_steps": 10}\nbye\n')
    line = scontrol_line("RUNNING", stdout=str(out)).rstrip("\n")
    line += " SubmitTime=2026-12-01T10:00:00 StartTime=2026-12-01T10:01:30\n"
    report = slurm.report("slurm://12", runner=FakeSlurm(scontrol=(0, line, "")))
    assert report.state == "RUNNING" and report.record["step"] == 8 and report.waited_s == 90.0
    pending = scontrol_line("PENDING", stdout=str(tmp_path / "none.out")).rstrip("\n")
    pending += " SubmitTime=2026-12-01T10:00:00 StartTime=2026-12-01T11:00:00\n"  # Slurm's estimate
    report = slurm.report("slurm://12", runner=FakeSlurm(scontrol=(0, pending, "")))
    assert report.state == "PENDING" and report.record is None and report.waited_s is None


RECORDED = Path(__file__).parent / "recorded"


@pytest.mark.parametrize("name,node1,worker3", [
    # the job files of test_slurm_e2e.py's two-node quickstart on the testbed, as Slurm wrote them
    ("slurm-torchrun-2node.out", 6, 0),  # torchrun mode: rank 3 logs nothing of its own
    ("slurm-srun-2node.out", 8, 4),  # srun mode: every line of task 3 carries its rank
])
def test_logs_of_recorded_testbed_jobs(tmp_path, name, node1, worker3):
    log = tmp_path / "demo-12.out"
    log.write_text((RECORDED / name).read_text())
    fake = FakeSlurm(scontrol=(0, scontrol_line("COMPLETED", stdout=str(log)), ""))

    def read(**query) -> list[str]:
        out = io.StringIO()
        slurm.logs("slurm://12", query=Query(**query), runner=fake, out=out)
        return out.getvalue().splitlines()

    shell = [line for line in log.read_text().splitlines() if line.startswith("ddpkit: ")]
    assert len(shell) == 2 and read(every=True) == log.read_text().splitlines()
    one = read(rank=1)
    assert len(one) == len(shell) + node1 and all("node rank 0" not in line for line in one)
    assert len(read(worker_rank=3)) == len(shell) + worker3
    [summary] = read(grep="^ddpkit-summary ")  # node 0's, the tag dropped, the JSON whole
    record = json.loads(summary.removeprefix("ddpkit-summary "))
    assert record["world_size"] == 4 and record["status"] == "completed"


def test_logs_attempt_and_previous_are_the_starts_of_a_requeued_job(tmp_path):
    """The file is opened for appending; each start of the job begins with the batch shell's
    `ddpkit: NAME (job J, restart K)` line (slurm/job.sh.j2): two recorded starts in a row."""
    first = (RECORDED / "slurm-torchrun-2node.out").read_text()
    second = first.replace("(job 2, restart 0)", "(job 2, restart 1)").replace("step 10/40", "step 10 again")
    log = tmp_path / "demo-12.out"
    log.write_text(first + second)
    fake = FakeSlurm(scontrol=(0, scontrol_line("COMPLETED", stdout=str(log)), ""))

    def read(**query) -> str:
        out = io.StringIO()
        slurm.logs("slurm://12", query=Query(every=True, **query), runner=fake, out=out)
        return out.getvalue()

    assert read(attempt=0) == first and read(previous=True) == first and read(attempt=1) == second
    with pytest.raises(UserError, match=r"holds attempts 0\.\.1: no attempt 2"):
        read(attempt=2)
    log.write_text(first)
    with pytest.raises(UserError, match=r"holds one attempt only \(0\): no previous attempt"):
        read(previous=True)
