"""End to end on a real two-node Slurm cluster (`ddpkit testbed slurm`, brought up here).

Needs root (network namespaces, daemons). They run with CI=true (a missing prerequisite then
fails) or when asked for with DDPKIT_SLURM_E2E=1; otherwise they skip with the reason, so a
developer's root shell does not start daemons and minutes of jobs unasked. Sessions that use
the testbed at the same time take turns (a lock file), so one never tears it down under another. Every job runs from its own temporary submit directory, with this
interpreter's environment activated through `slurm.venv` and the repository on PYTHONPATH
(sbatch passes the submitting environment on to the job, as on a real cluster).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.slurm import submit as submit_slurm
from deploy.testbed import slurm as testbed
from tests.conftest import IN_CI, REPO, ddpkit, held_testbed, require
from trainer.contract import read_node_line_tag

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EXAMPLE = REPO / "examples" / "quickstart-2node.yaml"
NODES = testbed.NODES
JOB_TIMEOUT_S = 180


@pytest.fixture(scope="session")
def cluster():
    """The testbed's client environment; the cluster comes up once and goes down at the end
    (unless it was already up before the tests: then it is left as it was)."""
    require(IN_CI or os.environ.get("DDPKIT_SLURM_E2E") == "1",
            "real-Slurm tests run with CI=true or DDPKIT_SLURM_E2E=1 (root: they start a 2-node testbed)")
    require(os.geteuid() == 0, "the Slurm testbed needs root (network namespaces, daemons)")
    require(importlib.util.find_spec("trainer.launch") is not None, "trainer.launch is missing")
    for tool in ("ip", "unshare", "nsenter"):
        require(shutil.which(tool) is not None, f"the Slurm testbed needs {tool} (iproute2, util-linux)")
    yield from held_testbed(testbed)


@pytest.fixture
def jobs(cluster):
    """Handles submitted by one test; whatever still runs when it ends is cancelled."""
    handles: list[str] = []
    yield handles
    for handle in handles:
        subprocess.run(["scancel", submit_slurm.job_id(handle)], env=cluster, capture_output=True)


def runner_for(env):
    def run(argv, **kw):
        return subprocess.run(argv, env=env, **kw)

    return run


def submit(cluster, jobs, workdir: Path, *extra: str) -> str:
    proc = ddpkit("submit", "slurm", str(EXAMPLE), "--set", f"slurm.venv={sys.prefix}", *extra,
                  cwd=workdir, env=cluster)
    assert proc.returncode == 0, proc.stderr
    handle = proc.stdout.strip()
    assert handle.startswith("slurm://"), proc.stdout
    jobs.append(handle)
    return handle


def wait_for(cluster, handle: str, states: set[str], timeout: float = JOB_TIMEOUT_S) -> str:
    run = runner_for(cluster)
    deadline = time.monotonic() + timeout
    while True:
        state = submit_slurm.status(handle, runner=run)
        if state in states:
            return state
        if state in submit_slurm.TERMINAL or time.monotonic() > deadline:
            log = job_log(cluster, handle).splitlines()
            # the end first (CI shows the head of a long failure): what ended it, then all of it
            pytest.fail(f"{handle} is {state}, expected {sorted(states)}\n--- the log's last 60 lines:\n"
                        + "\n".join(line[:300] for line in log[-60:])
                        + f"\n--- the daemons:\n{daemon_log_lines(submit_slurm.job_id(handle))}"
                        + "\n--- the whole log:\n" + "\n".join(log))
        time.sleep(0.5)


#: Daemon log lines that say nothing about a failure (the testbed logs slurmd at debug2).
DAEMON_LOG_NOISE = re.compile(r"PING|ping agent|node_did_resp|(Start|Finish) processing RPC|REQUEST_FED_INFO|"
                              r"REQUEST_JOB_INFO|pmix|MPI|profile signaling|debug levels are")
#: ... and those that do: RPCs a node got, signals, kills, requeues, a node's comings and goings.
DAEMON_LOG_EVENTS = re.compile(r"RPC|signal|[Kk]ill|CANCEL|[Tt]erminat|[Rr]equeu|responding|returned|"
                               r"[Ll]aunch|done with job|error", re.ASCII)


def daemon_log_lines(job_id: str, most: int = 40) -> str:
    """The testbed daemons' last log lines about this job or its nodes' RPCs, for a failure
    message: Slurm's own side of a step that was killed (who sent the signal, and when). The
    logs hold every job of the session: the lines are the last ones, most of them this job's."""
    out = []
    for log in sorted((testbed.testbed_dir() / "log").glob("slurm*.log")):
        lines = [line for line in log.read_text(errors="replace").splitlines()
                 if DAEMON_LOG_EVENTS.search(line) and not DAEMON_LOG_NOISE.search(line)]
        out += [f"{log.name}: {line[:240]}" for line in lines[-most:]]
    return "\n".join(out) or "(no daemon log lines)"


def job_log(cluster, handle: str) -> str:
    path = submit_slurm.log_path(handle, runner=runner_for(cluster))
    return path.read_text(errors="replace") if path.exists() else f"(no log at {path})"


def summaries(log: str) -> list[dict]:
    return [json.loads(line.split("ddpkit-summary ", 1)[1]) for line in log.splitlines()
            if "ddpkit-summary " in line]


def progress_records(log: str) -> list[dict]:
    """Rank 0's `ddpkit-progress` records in a job's log (one or more per attempt)."""
    return [json.loads(line.split("ddpkit-progress ", 1)[1]) for line in log.splitlines()
            if "ddpkit-progress {" in line]


def job_field(cluster, handle: str, key: str) -> str:
    info = submit_slurm.show_job(handle, runner=runner_for(cluster))
    assert info is not None
    return info[key]


def metric_steps(workdir: Path) -> list[int]:
    path = workdir / "runs" / "quickstart-2node" / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if "loss" in record and "step" in record:
            steps.append(record["step"])
    return steps


def wait_for_step(cluster, handle: str, workdir: Path, step: int) -> None:
    """Until the trainer logged `step` (so the job is mid-training)."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not metric_steps(workdir) or max(metric_steps(workdir)) < step:
        assert time.monotonic() < deadline, job_log(cluster, handle)
        state = submit_slurm.status(handle, runner=runner_for(cluster))
        assert state in ("PENDING", "RUNNING"), job_log(cluster, handle)
        time.sleep(0.2)


def assert_trained_on_two_nodes(summary: dict) -> None:
    assert summary["status"] == "completed", summary
    assert summary["world_size"] == 4
    assert sorted(r["rank"] for r in summary["ranks"]) == [0, 1, 2, 3]
    assert summary["hostnames"] == sorted(NODES), summary["hostnames"]
    assert summary["params_identical"] is True
    assert summary["final_loss"] < summary["first_loss"], summary


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_quickstart_runs_on_two_nodes(cluster, jobs, tmp_path, launcher):
    handle = submit(cluster, jobs, tmp_path, "--set", f"slurm.launcher={launcher}")
    wait_for(cluster, handle, {"SUCCEEDED"})
    log = job_log(cluster, handle)
    [summary] = summaries(log)
    assert_trained_on_two_nodes(summary)
    assert f"{launcher} mode" in log
    proc = ddpkit("logs", handle, env=cluster)
    assert proc.returncode == 0 and "ddpkit-summary" in proc.stdout
    # one file, two nodes: every line of the job step starts with its node (and rank), and the
    # long summary line is whole (srun --label cut it); --rank is a node, --worker-rank a process
    tags = [read_node_line_tag(line) for line in log.splitlines()]
    assert {tag[0] for tag in tags if tag} == {0, 1}, log[-3000:]
    assert all(line.startswith("ddpkit: ") for line, tag in zip(log.splitlines(), tags, strict=True)
               if tag is None), log[-3000:]
    node1 = ddpkit("logs", handle, "--rank", "1", env=cluster).stdout
    assert "node rank 1" in node1 and "node rank 0" not in node1 and "ddpkit-summary" not in node1
    assert not any(read_node_line_tag(line) for line in node1.splitlines())
    every = ddpkit("logs", handle, "--all", "--grep", "^\\[0/[0-9-]+\\] ddpkit-summary ", env=cluster).stdout
    [line] = every.splitlines()
    assert json.loads(line.split("ddpkit-summary ", 1)[1]) == summary
    if launcher == "srun":  # the task's rank tags each of its lines, the launcher's too
        worker3 = ddpkit("logs", handle, "--worker-rank", "3", env=cluster).stdout
        assert "context slurm-srun, node rank 1" in worker3, worker3
    # the progress record, from the end of the job's output file; the wait in the queue
    line = ddpkit("status", handle, env=cluster).stdout.strip()
    assert line.startswith("SUCCEEDED  step 40/40 (100%)") and "restarts 0/1" in line, line
    report = json.loads(ddpkit("status", handle, "--json", env=cluster).stdout)
    assert report["progress"]["state"] == "completed" and report["waited_s"] is not None, report
    why = ddpkit("why", handle, env=cluster).stdout.splitlines()
    assert why[0].startswith("completed: ") and why[-1] == "  scheduler: SUCCEEDED", why


def test_why_names_the_exception_and_its_node(cluster, jobs, tmp_path):
    """Rank 3 (node 1's second worker) raises at its 6th step, restarts: 0: `ddpkit why` reads
    the job's output file (the exception, torchrun's failed worker, the node's line tag); node
    0's ranks fail too, with gloo's "connection closed by peer": the consequence, not named."""
    job = write_job(tmp_path / "faulty.yaml", restarts=0, slurm={"requeue": False}, train={
        "model": "tests.user_workloads:faulty", "model_args": {"rank": 3, "after": 5, "fault": "raise"},
        "max_steps": 40, "epochs": 10, "batch_size": 32, "threads": 1, "eval_every_epochs": 0, "plot": False})
    proc = ddpkit("submit", "slurm", str(job), cwd=tmp_path, env=cluster)
    assert proc.returncode == 0, proc.stderr
    handle = proc.stdout.strip()
    jobs.append(handle)
    wait_for(cluster, handle, {"FAILED"})
    started = time.monotonic()
    why = ddpkit("why", handle, env=cluster)
    took = time.monotonic() - started
    first = why.stdout.splitlines()[0]
    print(f"why after {took:.1f}s: {first}")
    # torch prefixes the worker's traceback with [rank3]:, the launcher's tag carries it: rank and node
    # the run directory (the submit directory, shared) names the node's host; the log its node rank
    assert first.startswith(f"exception: rank 3 on {NODES[1]}, attempt 0: ValueError: injected fault on rank 3 "
                            "after 5 steps"), why.stdout
    assert log_cause_of(cluster, handle).startswith("exception: rank 3 on node 1: ValueError: injected fault")


def log_cause_of(cluster, handle: str) -> str:
    """What the job's output file alone says (deploy/why.py's log reader)."""
    from deploy.why import log_cause

    return log_cause(job_log(cluster, handle)).line()


def test_the_readme_python_api_example_submits_waits_and_reads_the_log(cluster, jobs, tmp_path, monkeypatch, capsys):
    """The README's cluster example of `import ddpkit`, as written, against the testbed: run
    from a directory holding the examples, with the testbed's Slurm commands on PATH and the
    job's venv set the way `submit()` above sets it for every job here."""
    from tests.test_api import readme_python_blocks

    code = readme_python_blocks()[1]
    overrides = '{"train.epochs": 1}'
    assert overrides in code
    code = code.replace(overrides, f'{{"train.epochs": 1, "slurm.venv": {sys.prefix!r}}}')
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    for key in ("PATH", "SLURM_CONF"):
        if key in cluster:
            monkeypatch.setenv(key, cluster[key])
    namespace: dict = {}
    try:
        exec(compile(code, "README.md", "exec"), namespace)
    finally:
        if "handle" in namespace:
            jobs.append(str(namespace["handle"]))
    out = capsys.readouterr().out
    assert out.startswith("slurm://"), out
    [summary] = summaries(job_log(cluster, str(namespace["handle"])))
    assert_trained_on_two_nodes(summary)


def test_preempted_job_checkpoints_requeues_resumes_and_never_reruns(cluster, jobs, tmp_path):
    # long enough to be signalled mid-run; checkpoints every 20 steps
    handle = submit(cluster, jobs, tmp_path, "--set", "train.max_steps=120",
                    "--set", "train.epochs=100", "--set", "train.plot=false")
    jobid = submit_slurm.job_id(handle)
    wait_for_step(cluster, handle, tmp_path, 30)
    # what `#SBATCH --signal=B:USR2@...` does before the time limit: USR2 to the batch shell only
    subprocess.run(["scancel", "--batch", "--signal=USR2", jobid], env=cluster, check=True)
    wait_for(cluster, handle, {"SUCCEEDED"})
    assert job_field(cluster, handle, "Restarts") == "1"
    log = job_log(cluster, handle)
    assert "requeueing (restart 1 of 1)" in log, log
    assert f"(job {jobid}, restart 1)" in log  # the second run saw SLURM_RESTART_COUNT=1
    stopped, final = summaries(log)
    assert stopped["status"] == "stopped" and stopped["steps"] < 120
    assert final["resumed_from_step"] == stopped["steps"], (stopped, final)
    assert final["steps"] == 120
    assert_trained_on_two_nodes(final)
    assert (tmp_path / "runs/quickstart-2node/checkpoints/FINISHED").exists()
    # `why`: completed, and the preempted attempt stopped after its checkpoint (the run directory)
    why = ddpkit("why", handle, env=cluster).stdout.splitlines()
    assert why[0] == "completed: attempt 1: step 120/120", why
    assert f"  attempt 0: stopped: attempt 0: after the checkpoint of step {stopped['steps']}" in why, why

    # started once more (requeued by hand): the FINISHED marker makes it exit at once
    subprocess.run(["scontrol", "requeue", jobid], env=cluster, check=True)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while job_field(cluster, handle, "Restarts") != "2" or (
            submit_slurm.status(handle, runner=runner_for(cluster)) != "SUCCEEDED"):
        assert time.monotonic() < deadline, job_log(cluster, handle)
        time.sleep(0.5)
    log = job_log(cluster, handle)
    assert log.rstrip().endswith("already finished, nothing to do"), log[-2000:]
    assert len(summaries(log)) == 2  # nothing trained again


@pytest.mark.parametrize("restarts,lost", [(1, "ddpkit-node1"), (0, "ddpkit-node2")])
def test_a_lost_node_requeues_and_resumes_or_ends_the_job_as_restarts_say(cluster, jobs, tmp_path, restarts, lost):
    """A node lost without warning (its slurmd and every job process SIGKILLed, no signal
    first; node1 is also the master and the batch host): slurmctld marks it DOWN after the
    testbed's SlurmdTimeout (10 s) and ends the job NODE_FAIL. With restarts >= 1 the job is
    requeued (--requeue), runs again once the node is back and resumes from the last
    checkpoint: steps lost <= checkpoint.every_steps (20). With restarts: 0 (--no-requeue)
    it stays FAILED and `ddpkit status` says why."""
    handle = submit(cluster, jobs, tmp_path, "--set", "train.max_steps=120", "--set", "train.epochs=100",
                    "--set", "train.plot=false", "--set", f"restarts={restarts}",
                    "--set", f"slurm.requeue={'true' if restarts else 'false'}")
    wait_for_step(cluster, handle, tmp_path, 30)
    try:
        assert testbed.kill_node(lost)
        ended = wait_for(cluster, handle, {"RESTARTING"} if restarts else {"FAILED"})
        last_step = max(metric_steps(tmp_path))  # nothing trains while a node is gone
        line = ddpkit("status", handle, env=cluster).stdout.strip()
    finally:
        testbed.start_node(lost)  # the node "reboots"; ReturnToService=2 takes it back
    checkpoints = sorted((tmp_path / "runs/quickstart-2node/checkpoints").glob("ckpt-*.pt"))
    assert checkpoints, "no checkpoint before the node was lost"
    if not restarts:
        assert ended == "FAILED" and job_field(cluster, handle, "JobState") == "NODE_FAIL"
        assert job_field(cluster, handle, "Restarts") == "0"
        assert line.startswith("FAILED (NODE_FAIL: a node of the job stopped responding"), line
        assert "not requeueable (restarts: 0)" in line, line
        why = ddpkit("why", handle, env=cluster).stdout.splitlines()
        assert why[0].startswith("node-lost: NODE_FAIL: a node of the job stopped responding"), why
        return
    assert line.startswith("RESTARTING") and "restart 1" in line, line
    wait_for(cluster, handle, {"SUCCEEDED"})
    assert job_field(cluster, handle, "Restarts") == "1"
    log = job_log(cluster, handle)
    assert f"(job {submit_slurm.job_id(handle)}, restart 1)" in log
    [final] = summaries(log)  # the lost run never got to write one
    lost_steps = last_step - final["resumed_from_step"]
    print(f"node lost at step {last_step}, resumed from {final['resumed_from_step']}: {lost_steps} steps lost")
    assert final["resumed_from_step"] % 20 == 0 and 0 <= lost_steps <= 20, (last_step, final)
    assert final["steps"] == 120
    assert_trained_on_two_nodes(final)
    assert (tmp_path / "runs/quickstart-2node/checkpoints/FINISHED").exists()


@pytest.mark.parametrize("nodes,spare", [("1", 1), ("1:2", 1)])
def test_a_lost_node_restarts_the_step_inside_the_allocation_without_it(cluster, jobs, tmp_path, nodes, spare):
    """`--no-kill` with somewhere to go: a spare node (1 node + 1 spare: the step runs on
    node2, node1 holds the batch shell), or an elastic range (1:2 nodes and a spare: Slurm
    allocates the range's low end, 1 + 1 = 2 nodes here, and the step runs on both).
    node2 is lost without warning (slurmd and every process SIGKILLed). The batch shell
    probes the step's nodes, leaves node2 out, and starts the step again on node1 inside the
    same allocation, from the newest checkpoint (no requeue, no wait for the node to come
    back). Elastic: at the smaller size, the global batch kept (2 ranks x 64 x grad_accum 2)."""
    handle = submit(cluster, jobs, tmp_path, "--set", "train.max_steps=120", "--set", "train.epochs=100",
                    "--set", "train.plot=false", "--set", "restarts=1", "--set", f"nodes={nodes}",
                    "--set", f"slurm.spare_nodes={spare}")
    wait_for_step(cluster, handle, tmp_path, 30)
    try:
        t_kill = time.monotonic()
        assert testbed.kill_node("ddpkit-node2")
        last_step = max(metric_steps(tmp_path))
        wait_for(cluster, handle, {"SUCCEEDED"})
        t_end = time.monotonic()
    finally:
        testbed.start_node("ddpkit-node2")
    assert job_field(cluster, handle, "Restarts") == "0"  # never requeued
    log = job_log(cluster, handle)
    assert "(job " in log and ", restart 0) on 2 nodes" in log, log[:500]
    assert "node ddpkit-node2 does not answer: leaving it out" in log, log[-3000:]
    assert "node ddpkit-node1 does not answer" not in log, log[-3000:]
    assert "starting it again inside the allocation (restart 1 of 1)" in log, log[-3000:]
    assert "job step on ddpkit-node1 (1 node(s))" in log, log[-3000:]
    [final] = summaries(log)  # the step on the lost node never wrote one
    assert final["status"] == "completed" and final["steps"] == 120
    assert final["hostnames"] == ["ddpkit-node1"] and final["world_size"] == 2
    assert 0 <= last_step - final["resumed_from_step"] <= 20, (last_step, final)
    if nodes == "1:2":
        assert "keeps its global batch of 256 samples as 2 ranks x 64 x grad_accum 2" in log, log[-3000:]
    # every step's launchers forked torchrun and the workers from the allocation's templates
    # (trainer/warm.py --resident): rank 0 stayed on node1 with 1:2, so both attempts' workers
    # came from the same template process
    assert log.count("forked from the allocation's template") == (3 if nodes == "1:2" else 2), log[-3000:]
    templates = {rec["attempt"]: rec["start"]["template_pid"] for rec in progress_records(log)}
    assert sorted(templates) == [0, 1] and (templates[0] == templates[1]) == (nodes == "1:2"), templates
    print(f"node lost at step {last_step}, resumed from {final['resumed_from_step']} on node1; "
          f"kill -> end of job {t_end - t_kill:.0f} s")


def test_cancel_leaves_no_process_on_either_node(cluster, jobs, tmp_path):
    handle = submit(cluster, jobs, tmp_path, "--set", "train.max_steps=100000",
                    "--set", "train.epochs=1000")
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not metric_steps(tmp_path):
        assert time.monotonic() < deadline, job_log(cluster, handle)
        time.sleep(0.2)
    proc = ddpkit("cancel", handle, env=cluster)
    assert proc.returncode == 0, proc.stderr
    assert submit_slurm.status(handle, runner=runner_for(cluster)) == "CANCELLED"
    deadline = time.monotonic() + 20
    while True:
        left = {node: leftover_processes(node) for node in NODES}
        if not any(left.values()):
            break
        assert time.monotonic() < deadline, f"still running after cancel: {left}"
        time.sleep(0.5)


def leftover_processes(node: str) -> list[str]:
    """Processes in the node's namespace other than its slurmd."""
    out = []
    for pid in testbed.node_pids(node):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if comm != "slurmd" and state != "Z":
            out.append(f"{pid}:{comm}")
    return out


def test_submitit_runs_the_same_job_and_requeues_it(cluster, jobs, tmp_path):
    handle = submit(cluster, jobs, tmp_path, "--via", "submitit", "--set", "train.plot=false",
                    "--set", "train.max_steps=80", "--set", "train.epochs=100")
    wait_for_step(cluster, handle, tmp_path, 20)
    # what submitit's `--signal=USR2@...` does before the time limit: USR2 to the job's tasks
    subprocess.run(["scancel", "--signal=USR2", submit_slurm.job_id(handle)], env=cluster, check=True)
    wait_for(cluster, handle, {"SUCCEEDED"})
    assert job_field(cluster, handle, "Restarts") == "1"
    stopped, final = summaries(job_log(cluster, handle))
    assert stopped["status"] == "stopped" and final["resumed_from_step"] == stopped["steps"]
    assert final["steps"] == 80
    assert_trained_on_two_nodes(final)


# ---------------------------------------------------------------------------------------------
# issue 11: the README's path, secrets, --mem=0, the time-limit signal, submitit's parity


def write_job(path: Path, *, slurm: dict | None = None, **fields) -> Path:
    """The 2-node example with this interpreter's venv (as `submit` does with --set)."""
    import yaml

    data = yaml.safe_load(EXAMPLE.read_text())
    data["slurm"] = {**data.get("slurm", {}), "venv": sys.prefix, **(slurm or {})}
    data.update(fields)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_readme_render_then_sbatch_runs_as_written(cluster, jobs, tmp_path):
    """`ddpkit render slurm job.yaml -o job.sbatch && sbatch job.sbatch`, literally: nothing
    else creates the log directory (Slurm fails a job whose log it cannot open, silently)."""
    write_job(tmp_path / "job.yaml")
    assert not (tmp_path / "logs").exists()
    ddpkit_cmd = f"{sys.executable} -m deploy"
    proc = subprocess.run(["bash", "-c", f"{ddpkit_cmd} render slurm job.yaml -o job.sbatch && sbatch job.sbatch"],
                          cwd=tmp_path, env=cluster, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    jobid = proc.stdout.strip().split()[-1]
    assert proc.stdout.startswith("Submitted batch job") and jobid.isdigit(), proc.stdout
    handle = f"slurm://{jobid}"
    jobs.append(handle)
    wait_for(cluster, handle, {"SUCCEEDED"})
    [summary] = summaries(job_log(cluster, handle))
    assert_trained_on_two_nodes(summary)
    assert (tmp_path / "logs" / f"quickstart-2node-{jobid}.out").exists()


def squeue_ids(cluster) -> set[str]:
    proc = subprocess.run(["squeue", "-h", "-o", "%i"], env=cluster, capture_output=True, text=True)
    return set(proc.stdout.split())


def test_a_missing_secret_stops_submit_before_sbatch_and_a_set_one_reaches_the_job(cluster, jobs, tmp_path):
    """Also --mem=0 (slurm.all_memory): real Slurm gives the job all of each node's memory."""
    check = 'test "$API_TOKEN" = s3cret && echo "token-ok on $(hostname)"'
    path = write_job(tmp_path / "job.yaml", slurm={"all_memory": True},
                     secret_env=[{"name": "API_TOKEN", "secret": "api", "key": "token"}],
                     command=["bash", "-c", check])
    data = path.read_text().replace("  memory: 4Gi\n", "")  # all_memory instead of resources.memory
    path.write_text(data)
    env = {k: v for k, v in cluster.items() if k != "API_TOKEN"}
    before = squeue_ids(cluster)
    proc = ddpkit("submit", "slurm", str(path), cwd=tmp_path, env=env)
    assert proc.returncode == 2 and "secret_env.0.name: API_TOKEN is not set" in proc.stderr, proc.stderr
    assert proc.stdout == "" and squeue_ids(cluster) <= before  # nothing was submitted
    proc = ddpkit("submit", "slurm", str(path), cwd=tmp_path, env={**env, "API_TOKEN": "s3cret"})
    assert proc.returncode == 0, proc.stderr
    handle = proc.stdout.strip()
    jobs.append(handle)
    wait_for(cluster, handle, {"SUCCEEDED"})
    log = job_log(cluster, handle)
    assert sorted(line.split()[-1] for line in log.splitlines() if "token-ok" in line) == sorted(NODES), log
    # sbatch accepted --mem=0 and Slurm keeps the request as 0, its "all of each node's memory"
    assert job_field(cluster, handle, "MinMemoryNode") == "0"


def test_a_time_limit_without_requeue_checkpoints_before_the_limit(cluster, jobs, tmp_path):
    """Slurm's own --signal=B:USR2@90 on a 3-minute job (Slurm may signal up to a minute early):
    the trainer checkpoints and stops before the limit (not killed at it), no requeue."""
    path = write_job(tmp_path / "job.yaml", slurm={"requeue": False, "signal_seconds": 90},
                     time_limit="3m", restarts=0)
    proc = ddpkit("submit", "slurm", str(path), "--set", "train.max_steps=100000",
                  "--set", "train.epochs=1000", "--set", "train.plot=false", cwd=tmp_path, env=cluster)
    assert proc.returncode == 0, proc.stderr
    handle = proc.stdout.strip()
    jobs.append(handle)
    state = wait_for(cluster, handle, {"SUCCEEDED", "FAILED"}, timeout=240)
    log = job_log(cluster, handle)
    assert "SIGUSR2 received" in log and "stopped before the time limit (checkpointed)" in log, log[-3000:]
    [stopped] = summaries(log)
    assert stopped["status"] == "stopped" and stopped["steps"] > 0
    assert state == "FAILED" and job_field(cluster, handle, "Restarts") == "0"
    assert "TIMEOUT" not in job_field(cluster, handle, "JobState")
    assert list((tmp_path / "runs" / "quickstart-2node" / "checkpoints").glob("*"))


def test_submitit_takes_the_elastic_range_and_extra_directives(cluster, jobs, tmp_path):
    handle = submit(cluster, jobs, tmp_path, "--via", "submitit", "--set", "nodes=1:2",
                    "--set", "slurm.extra_directives=[--comment=ddpkit-e2e]", "--set", "train.plot=false")
    wait_for(cluster, handle, {"SUCCEEDED"})
    assert job_field(cluster, handle, "Comment").strip() == "ddpkit-e2e"
    # submitit's script asks for the range, once (Slurm picks the count: 1 when a node is still
    # busy with the previous test's job, as seen here)
    [script] = (tmp_path / "logs" / "submitit").glob(f"{submit_slurm.job_id(handle)}_submission.sh")
    lines = script.read_text().splitlines()
    assert [x for x in lines if x.startswith("#SBATCH --nodes")] == ["#SBATCH --nodes=1-2"]
    assert lines.count("#SBATCH --comment=ddpkit-e2e") == 1
    nodes = int(job_field(cluster, handle, "NumNodes"))
    [summary] = summaries(job_log(cluster, handle))
    assert summary["status"] == "completed" and summary["world_size"] == 2 * nodes, summary


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_your_own_torchrun_script_runs_unchanged_on_two_nodes(cluster, jobs, tmp_path, launcher):
    """examples/own_script/train.py (textbook DDP, no ddpkit) as `script:`: 2 nodes x 2 ranks,
    identical parameters on all four; the script sits in the shared submit directory."""
    shutil.copy(REPO / "examples" / "own_script" / "train.py", tmp_path / "train.py")
    proc = ddpkit("submit", "slurm", str(REPO / "examples" / "own-script.yaml"),
                  "--set", f"slurm.venv={sys.prefix}", "--set", "nodes=2", "--set", "script=train.py",
                  "--set", "args=[--epochs, '1', --samples, '1024', --out, out]",
                  "--set", f"slurm.launcher={launcher}", cwd=tmp_path, env=cluster)
    assert proc.returncode == 0, proc.stderr
    handle = proc.stdout.strip()
    jobs.append(handle)
    wait_for(cluster, handle, {"SUCCEEDED"})
    log = job_log(cluster, handle)
    lines = re.findall(r"rank (\d)/4 on (\S+): params sha256 ([0-9a-f]{64})", log)
    assert sorted(int(r) for r, _, _ in lines) == [0, 1, 2, 3], log[-3000:]
    assert {h for _, h, _ in lines} == set(NODES)  # both nodes trained
    assert len({s for _, _, s in lines}) == 1  # identical on every rank
    files = {p.read_text().strip() for p in (tmp_path / "out").glob("params-rank*.sha256")}
    assert files == {lines[0][2]}
    assert f"{launcher} mode" in log and "train.py --epochs 1" in log


# ---------------------------------------------------------------------------------------------
# issue 20: the fault corpus on Slurm (docs/faults.md "Why did it fail?"), four jobs at once (each node
# advertises 4 CPUs; each job takes 1 a node): a hang in each launch mode, your own script's
# collective timeout, and a job that outlives its time limit.


def corpus_job(directory: Path, name: str, **fields) -> str:
    import yaml

    directory.mkdir()
    data = yaml.safe_load(EXAMPLE.read_text())
    data.update(name=name, restarts=0, resources={"cpus_per_node": 1, "memory": "2Gi"})
    data["slurm"] = {**data["slurm"], "venv": sys.prefix, "requeue": False}
    for key, value in fields.items():
        if value is None:
            data.pop(key, None)
            continue
        data[key] = {**data[key], **value} if isinstance(data.get(key), dict) and isinstance(value, dict) else value
    (directory / "job.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return str(directory / "job.yaml")


def hang_train(where: str, marker: Path) -> dict:
    """Rank 3 (node 1's second worker) stops once, asleep in its forward or stuck in its
    DataLoader worker; restarts 0: the watchdog's verdict ends the job."""
    return {"model": "tests.user_workloads:hang", "max_steps": 400, "epochs": 100, "batch_size": 32,
            "threads": 1, "eval_every_epochs": 0, "plot": False, "log_every_steps": 5,
            "num_workers": 1 if where == "data" else 0,
            "model_args": {"where": where, "rank": 3, "after": 1200 if where == "data" else 30,
                           "marker": str(marker)}}


#: the watchdog's cases: where rank 3 stops -> (cause, what the verdict says of rank 3 on node 2)
HANG_KINDS = {"data": ("stuck-outside-collective", "rank 3 on {node} in data"),
              "forward": ("stuck-outside-collective", "rank 3 on {node} in forward"),
              "stop": ("frozen", "rank 3 on {node} (pid ")}


def test_the_fault_corpus_on_slurm(cluster, jobs, tmp_path):
    """Submitted together (Slurm starts each when its nodes have the CPUs), then each checked:
    (1) rank 3 stuck in a DataLoader worker, asleep in its forward, or SIGSTOPped (frozen: its
    stacks read by py-spy from rank 2), each in torchrun mode and in srun mode: the watchdog
    names rank 3 on node 2 within 30 s, every rank's stacks under the run directory, `why`
    says hang, rank and node; (2) your own torchrun script (tests/hang_script.py) whose rank 3
    sleeps: rank 0's 10 s process-group timeout fires, every rank's stacks are written and the
    launcher's verdict names rank 3 on node 2; (3) a job that ignores the warning signal and
    outlives its 1-minute limit: Slurm ends it TIMEOUT, `why` says time-limit. `why` answers
    within 10 s of each end."""
    shutil.copy(REPO / "tests" / "hang_script.py", tmp_path / "hang_script.py")
    cases = {  # 4 CPUs a node: srun mode takes 2, torchrun mode 1; the later ones wait their turn
        "time-limit": corpus_job(tmp_path / "time-limit", "time-limit", nodes=1, procs_per_node=1, time_limit="1m",
                                 command=["bash", "-c", "trap '' USR2; exec sleep 600"],
                                 slurm={"signal_seconds": 10}, checkpoint={"ephemeral": True}),
    }
    for where in HANG_KINDS:
        for mode in ("torchrun", "srun"):
            name = f"hang-{where}-{mode}"
            cases[name] = corpus_job(tmp_path / name, name, train=hang_train(where, tmp_path / f"hung-{name}"),
                                     **({"slurm": {"launcher": "srun"}, "resources": {"cpus_per_node": 2, "memory": "2Gi"}}
                                        if mode == "srun" else {}))
    cases["script-timeout"] = corpus_job(tmp_path / "script-timeout", "script-timeout", train=None, checkpoint=None,
                                         script=str(tmp_path / "hang_script.py"), env={"HANG_RANK": "3", "TIMEOUT_S": "10"})
    handles = {}
    for name, path in cases.items():
        proc = ddpkit("submit", "slurm", path, cwd=Path(path).parent, env=cluster)
        assert proc.returncode == 0, f"{name}: {proc.stderr}"
        handles[name] = proc.stdout.strip()
        jobs.append(handles[name])

    def ended(name: str, states: set[str], timeout: float = 300) -> list[str]:
        wait_for(cluster, handles[name], states, timeout=timeout)
        started = time.monotonic()
        why = ddpkit("why", handles[name], env=cluster)
        took = time.monotonic() - started
        print(f"{name}: why answered {took:.1f}s after the end: {why.stdout.splitlines()[:1]}")
        assert why.returncode == 0, why.stderr  # how soon: a figure of bench/fault_corpus.py
        return why.stdout.splitlines()

    node2 = NODES[1]
    expected = {f"hang-{where}-{mode}": (cause, said.format(node=node2))
                for where, (cause, said) in HANG_KINDS.items() for mode in ("torchrun", "srun")}
    for name, (cause, said) in expected.items():
        why = ended(name, {"FAILED"})
        log = job_log(cluster, handles[name])
        verdicts = [json.loads(line.split("ddpkit-hang ", 1)[1]) for line in log.splitlines() if "ddpkit-hang " in line]
        assert verdicts, log[-3000:]
        found = verdicts[0]
        print(f"{name}: found {found['age_s']}s after rank 3 stopped: {found['explain']}")
        assert found["culprits"] == [3] and found["cause"] == cause, found
        assert said in found["explain"], found
        debug = tmp_path / name / "runs" / name / "debug" / "attempt-0"
        stacks = sorted(p.name for p in debug.glob("rank-*.txt"))
        assert stacks == [f"rank-{r}.txt" for r in range(4)], stacks
        assert "Thread" in (debug / "rank-3.txt").read_text()
        if cause == "frozen":  # rank 2, on its node, read the stopped rank's stacks with py-spy
            frozen = (debug / "rank-3.txt").read_text()
            assert "stopped (T (stopped)); its stacks read from outside by py-spy" in frozen, frozen
            assert "maybe_hang" in frozen, frozen
        assert why[0].startswith(f"hang: rank 3 on {node2}, attempt 0: {said}"), why

    why = ended("script-timeout", {"FAILED"})
    debug = tmp_path / "script-timeout" / "runs" / "script-timeout" / "debug" / "attempt-0"
    assert sorted(p.name for p in debug.glob("rank-*.txt")) == [f"rank-{r}.txt" for r in range(4)]
    assert "time.sleep" in (debug / "rank-3.txt").read_text() or "hang_script.py\", line 20" in (debug / "rank-3.txt").read_text()
    verdict = json.loads((debug / "verdict.txt").read_text().split("\n}", 1)[0] + "\n}")
    assert verdict["cause"] == "collective-timeout" and verdict["culprits"] == [3], verdict
    assert why[0].startswith(f"hang: rank 3 on {node2}, attempt 0: collective timeout on rank "), why
    assert "hang_script.py:20 in main (outside any collective)" in why[0], why

    why = ended("time-limit", {"FAILED"}, timeout=240)
    assert job_field(cluster, handles["time-limit"], "JobState") == "TIMEOUT"
    assert why[0].startswith("time-limit: "), why


# ---------------------------------------------------------------------------------------------
# issue 40: `workdir:` the tree snapshotted at submit; an edit while the job waits changes nothing

WORKDIR_SCRIPT = """import os
VERSION = "{version}"
print(f"workdir-version {{VERSION}} in {{os.getcwd()}} restart {{os.environ.get('SLURM_RESTART_COUNT', '0')}}", flush=True)
"""


def test_workdir_runs_the_submitted_tree_after_an_edit_in_the_queue_and_after_a_requeue(cluster, jobs, tmp_path):
    """Submitted held (`#SBATCH --hold` through slurm.extra_directives), train.py edited, then
    released: the job prints the submitted version; requeued by hand, it prints it again."""
    import yaml

    from deploy import workdir
    from deploy.load import load_job

    tree = tmp_path / "proj"
    tree.mkdir()
    (tree / "train.py").write_text(WORKDIR_SCRIPT.format(version="submitted"))
    (tree / "job.yaml").write_text(yaml.safe_dump({
        "name": "wd-e2e", "image": "ddpkit:0.1", "script": "train.py", "workdir": ".", "restarts": 1,
        "resources": {"cpus_per_node": 1}, "slurm": {"venv": sys.prefix, "extra_directives": ["--hold"]}}))
    snap = workdir.snapshot(load_job(str(tree / "job.yaml")))
    proc = ddpkit("submit", "slurm", str(tree / "job.yaml"), cwd=tree, env=cluster)
    assert proc.returncode == 0, proc.stderr
    assert f"shipped: workdir {tree} ({snap.describe()})" in proc.stderr
    handle = proc.stdout.strip()
    jobs.append(handle)
    jobid = submit_slurm.job_id(handle)
    assert (job_field(cluster, handle, "JobState"), job_field(cluster, handle, "Priority")) == ("PENDING", "0")  # held
    time.sleep(3)  # a scheduling pass or two: the job stays in the queue, held
    assert job_field(cluster, handle, "JobState") == "PENDING"
    (tree / "train.py").write_text(WORKDIR_SCRIPT.format(version="edited"))
    subprocess.run(["scontrol", "release", jobid], env=cluster, check=True)
    wait_for(cluster, handle, {"SUCCEEDED"})
    copy = tree / "logs" / f"wd-e2e-workdir-{snap.short}"
    assert re.findall(r"workdir-version (\S+) in (\S+) restart (\d)", job_log(cluster, handle)) == \
        [("submitted", str(copy), "0")]
    subprocess.run(["scontrol", "requeue", jobid], env=cluster, check=True)
    deadline = time.monotonic() + 2 * JOB_TIMEOUT_S  # a requeued job waits before it is eligible again
    while not (job_field(cluster, handle, "Restarts") == "1" and
               submit_slurm.status(handle, runner=runner_for(cluster)) == "SUCCEEDED"):
        assert time.monotonic() < deadline, job_log(cluster, handle)
        time.sleep(0.5)
    assert re.findall(r"workdir-version (\S+) in (\S+) restart (\d)", job_log(cluster, handle)) == \
        [("submitted", str(copy), "0"), ("submitted", str(copy), "1")]


def test_an_accelerate_script_on_two_nodes_succeeds_or_hangs_and_ddpkit_says_which(cluster, jobs, tmp_path):
    """tests/frameworks/accelerate_loop.py (an Accelerate loop of our own, no ddpkit in it) as
    `script:` on 2 nodes x 1 rank, two jobs at once: one trains (same parameters on both nodes;
    `status` counts its 20 steps; `why` says completed), one whose rank 1 (on node 2) sleeps in
    its own code at step 8: the script watchdog ends it, naming rank 1, its node and its line."""
    import yaml

    handles = {}
    for fault in ("", "hang"):
        folder = tmp_path / (fault or "ok")
        folder.mkdir()
        shutil.copy(REPO / "tests" / "frameworks" / "accelerate_loop.py", folder / "loop.py")
        job = {"name": f"acc-{fault or 'ok'}", "image": "ddpkit:0.1", "nodes": 2, "procs_per_node": 1,
               "resources": {"cpus_per_node": 1, "memory": "2Gi"}, "script": "loop.py", "steps": 20, "restarts": 0,
               "env": {"OMP_NUM_THREADS": "1", "FAULT": fault, "STEPS": "20"}, "train": {"hang_floor_s": 3},
               "slurm": {"venv": sys.prefix, "requeue": False}}
        (folder / "job.yaml").write_text(yaml.safe_dump(job))
        proc = ddpkit("submit", "slurm", str(folder / "job.yaml"), cwd=folder, env=cluster)
        assert proc.returncode == 0, proc.stderr
        handles[fault] = proc.stdout.strip()
        jobs.append(handles[fault])
    wait_for(cluster, handles[""], {"SUCCEEDED"})
    log = job_log(cluster, handles[""])
    sums = set(re.findall(r"rank \d/2: params sha256 ([0-9a-f]{64})", log))
    assert len(sums) == 1 and len(re.findall(r"rank \d/2: params sha256", log)) == 2, log[-3000:]
    progress = json.loads(ddpkit("status", handles[""], "--json", env=cluster).stdout)["progress"]
    assert (progress["step"], progress["state"]) == (20, "completed"), progress
    why = ddpkit("why", handles[""], env=cluster).stdout.splitlines()
    assert why[0] == "completed: attempt 0: step 20/20", why

    wait_for(cluster, handles["hang"], {"FAILED"})
    why = ddpkit("why", handles["hang"], env=cluster).stdout.splitlines()
    line = next(i for i, text in enumerate((REPO / "tests/frameworks/accelerate_loop.py").read_text().splitlines(), 1)
                if "FAULT=hang" in text and "sleep" in text)
    assert why[0].startswith("hang: rank 1 on ddpkit-node2"), why
    assert f"loop.py:{line} in main (outside any collective)" in why[0], why
