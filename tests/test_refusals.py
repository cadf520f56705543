"""`validate` means what `render` means (deploy/problems.py): every refusal a renderer makes is
found by `ddpkit validate` too, with the same line (file and line of the field), and exit 2.

REFUSALS is the catalogue: one job per refusal, with the target (and flavor) that refuses it and
the start of the located line. Add a row for every new check.
"""

from __future__ import annotations

import pytest
import yaml

from deploy.cli import main
from deploy.durability import OPT_OUT, k8s_problems, slurm_problems
from deploy.load import parse_job as parse
from tests.builders import merged

BASE = "name: demo\nimage: img:1\n"

# (id, job file body after BASE, target, flavor or None, expected "LINE: path: message" start)
EPHEMERAL = "checkpoint: {ephemeral: true}\n"  # line 3: multi-node rows about something else

REFUSALS = [
    ("elastic on a fixed-size flavor", EPHEMERAL + "nodes: '2:4'\nk8s:\n  flavor: jobset\n", "k8s",
     None, "4: nodes: elastic 2:4 needs the pytorchjob flavor"),
    ("gang without a queue", "k8s:\n  flavor: job\n  gang: true\n", "k8s", None,
     "5: k8s.gang: the job flavor is gang-admitted by Kueue"),
    ("what a TrainJob cannot set", "k8s:\n  flavor: trainjob\n  priority_class: high\n", "k8s",
     None, "5: k8s.priority_class: a TrainJob cannot set it"),
    ("cleanPodPolicy on another flavor", "k8s:\n  clean_pod_policy: All\n", "k8s", "job",
     "4: k8s.clean_pod_policy: PyTorchJob only"),
    ("tolerationSeconds without NoExecute",
     "k8s:\n  tolerations:\n  - key: gpu\n    effect: NoSchedule\n    toleration_seconds: 60\n",
     "k8s", None, "6: k8s.tolerations.0.effect: Invalid value: \"NoSchedule\": effect must be 'NoExecute' "
     "when `tolerationSeconds` is set"),
    ("a label that overrides the Service selector",
     "k8s:\n  labels:\n    app.kubernetes.io/instance: other\n", "k8s", None,
     "4: k8s.labels.app.kubernetes.io/instance: ddpkit selects the job's pods by this label"),
    ("a queue label contradicting k8s.queue",
     "k8s:\n  queue: team-a\n  labels:\n    kueue.x-k8s.io/queue-name: team-b\n", "k8s", None,
     "5: k8s.labels.kueue.x-k8s.io/queue-name: contradicts k8s.queue ('team-a')"),
    ("hostNetwork on a TrainJob", "k8s:\n  flavor: trainjob\n  host_network: true\n", "k8s",
     None, "5: k8s.host_network: a TrainJob cannot set it"),
    ("a pod_patch field a PodSpec lacks", "k8s:\n  pod_patch:\n    spec:\n      nodeSelectr: {}\n",
     "k8s", None, "6: k8s.pod_patch.spec.nodeSelectr: not a PodSpec field; did you mean 'nodeSelector'?"),
    ("a pod_patch of a container the pod lacks",
     "k8s:\n  pod_patch:\n    spec:\n      containers:\n      - name: main\n", "k8s", None,
     "7: k8s.pod_patch.spec.containers.0.name: no container 'main' in the pod"),
    ("a time limit shorter than the grace period", "time_limit: 60s\nk8s: {}\n", "k8s", None,
     "3: time_limit: 60s leaves no time to train"),
    ("a Slurm-only image form on Kubernetes", "k8s: {flavor: job}\n", "k8s", None, ""),
    ("checkpoints in a pod's container", "nodes: 2\nk8s: {flavor: jobset}\n", "k8s", None,
     "1: checkpoint.dir: 'runs/demo/checkpoints' is in the container's working directory"),
    ("checkpoints on an emptyDir", "restarts: 2\ncheckpoint: {dir: /scratch/ckpt}\nvolumes:\n"
     "  - {name: s, mount: /scratch, empty_dir: {}}\nk8s: {flavor: job}\n", "k8s", None,
     "4: checkpoint.dir: /scratch/ckpt is on empty_dir volume s"),
    ("a log dir sbatch cannot take", "slurm:\n  log_dir: my logs\n", "slurm", None,
     "4: slurm.log_dir: 'my logs' cannot go into an #SBATCH line"),
    ("checkpoints inside a Slurm container", "nodes: 2\ncheckpoint: {dir: /ckpt}\nslurm:\n"
     "  container: apptainer\n", "slurm", None, "4: checkpoint.dir: /ckpt is inside the apptainer container"),
    ("checkpoints at a host_path volume's mount, no container", "restarts: 1\ncheckpoint: {dir: /ckpt/a}\n"
     "volumes: [{name: c, host_path: /lustre/c, mount: /ckpt}]\nslurm: {partition: gpu}\n", "slurm",
     None, "4: checkpoint.dir: /ckpt/a is under the mount of volume c"),
    ("checkpoints in a node-local directory, no container", "restarts: 1\ncheckpoint: {dir: /tmp/ckpt}\n"
     "slurm: {partition: gpu}\n", "slurm", None, "4: checkpoint.dir: /tmp/ckpt is in /tmp, which is node-local"),
    ("checkpoints in a variable no target expands", "checkpoint: {dir: $TMPDIR/ckpt}\n", "slurm",
     None, "3: checkpoint.dir: '$TMPDIR/ckpt': no target expands $VARIABLES"),
    ("restarts nothing implements", "restarts: 2\nslurm: {launcher: srun}\n", "slurm", None,
     "3: restarts: 2 in srun mode, but with slurm.requeue off only a lost node"),
    ("CPUs that do not split over srun tasks", "gpus_per_node: 4\nresources: {cpus_per_node: 10}\n"
     "slurm: {launcher: srun}\n", "slurm", None, "4: resources.cpus_per_node: 10 CPUs over 4 Slurm tasks"),
    ("a time limit inside the signal lead", "time_limit: 90s\nslurm: {signal_seconds: 120}\n", "slurm",
     None, "3: time_limit: 1m30s must exceed slurm.signal_seconds (120s)"),
    ("an Apptainer image for pyxis", "slurm: {container: pyxis}\n", "slurm", None, ""),
]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("body,target,flavor,expected", [r[1:] for r in REFUSALS],
                         ids=[r[0] for r in REFUSALS])
def test_render_and_validate_refuse_with_the_same_located_line(tmp_path, capsys, body, target,
                                                               flavor, expected):
    path = tmp_path / "job.yaml"
    if not expected:  # the image rows: image on line 2
        image = "/images/t.sif" if "pyxis" in body else "registry.example#nvidia/pytorch:24.05-py3"
        path.write_text(BASE.replace("img:1", image) + body)
        expected = "2: image: "
    else:
        path.write_text(BASE + body)
    extra = ["--flavor", flavor] if flavor else []
    rendered = run(capsys, "render", target, str(path), *extra, "-o", str(tmp_path / "out"))
    assert rendered[0] == 2 and rendered[1] == ""
    assert rendered[2].startswith(f"error: {path}:{expected}"), rendered[2]
    assert not (tmp_path / "out").exists()
    # validate with the target named, and with the target found from the job's own sections
    assert run(capsys, "validate", str(path), "--target", target, *extra) == rendered
    assert run(capsys, "validate", str(path), *extra) == rendered


def test_validate_checks_the_targets_whose_section_the_job_writes(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    # a job for Slurm only: a k8s refusal (elastic on jobset via --set would write k8s) is not
    # looked for, and a clean Slurm job is ok
    path.write_text(BASE + "slurm:\n  partition: gpu\n")
    code, out, err = run(capsys, "validate", str(path))
    assert (code, err) == (0, "") and out.endswith("checked for slurm\n")
    # --set writes a section too
    code, out, err = run(capsys, "validate", str(path), "--set", "k8s.flavor=job")
    assert code == 0 and out.endswith("checked for k8s (job), slurm\n")
    # neither section: every target
    path.write_text(BASE)
    code, out, err = run(capsys, "validate", str(path))
    assert code == 0 and out.endswith("checked for k8s (pytorchjob), slurm\n")


def test_validate_reports_every_target_s_problems_at_once(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(BASE + EPHEMERAL + "nodes: '2:4'\nk8s:\n  flavor: job\nslurm:\n  log_dir: a b\n")
    code, out, err = run(capsys, "validate", str(path))
    assert code == 2 and out == ""
    assert err.splitlines() == [
        f"error: {path}:4: nodes: elastic 2:4 needs the pytorchjob flavor (elasticPolicy); job "
        "runs a fixed node count; set nodes: 4 or --flavor pytorchjob",
        f"error: {path}:8: slurm.log_dir: 'a b' cannot go into an #SBATCH line; use letters, "
        "digits and _.,:@%+=/|&~- only (no spaces or quotes)"]
    # one target at a time
    assert run(capsys, "validate", str(path), "--target", "slurm")[2] == err.splitlines(True)[1]
    assert run(capsys, "validate", str(path), "--target", "k8s")[2] == err.splitlines(True)[0]


def test_a_refusal_from_an_override_names_the_override(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(BASE + EPHEMERAL + "nodes: 2\n")
    code, _, err = run(capsys, "validate", str(path), "--set", "nodes=2:4", "--flavor", "job")
    assert code == 2 and err.startswith("error: --set nodes: nodes: elastic 2:4 needs"), err


# Every node-local directory, reached every way a target puts checkpoints on a host directory
# (deploy/durability.py NODE_LOCAL; Slurm's job_container.conf(5) makes /tmp and /dev/shm per job)
NODE_LOCAL_FORMS = {
    "bare Slurm": lambda d: {"checkpoint": {"dir": f"{d}/ckpt"}, "slurm": {"partition": "gpu"}},
    "bare Slurm, via train.output_dir": lambda d: {"train": {"output_dir": f"{d}/runs"},
                                                   "slurm": {"partition": "gpu"}},
    "a pyxis mount's source": lambda d: {
        "checkpoint": {"dir": "/ckpt/a"}, "slurm": {"container": "pyxis", "container_mounts": [f"{d}/x:/ckpt"]}},
    "an Apptainer host_path volume": lambda d: {
        "checkpoint": {"dir": "/ckpt"}, "volumes": [{"name": "c", "host_path": f"{d}/c", "mount": "/ckpt"}],
        "slurm": {"container": "apptainer"}},
    "a Kubernetes host_path volume": lambda d: {
        "checkpoint": {"dir": "/ckpt"}, "volumes": [{"name": "c", "host_path": f"{d}/c", "mount": "/ckpt"}],
        "k8s": {"flavor": "jobset"}},
}


@pytest.mark.parametrize("form", NODE_LOCAL_FORMS)
@pytest.mark.parametrize("local", ["/dev/shm", "/tmp", "/var/tmp", "/run", "/local", "/scratch/local",
                                   "/localscratch", "/lscratch"])
def test_node_local_checkpoints_are_refused_where_a_restart_reads_them(local, form):
    data = merged({"name": "demo", "image": "registry.example/o/t:1", "nodes": 2, "restarts": 1},
                  NODE_LOCAL_FORMS[form](local))
    check = k8s_problems if "k8s" in data else slurm_problems
    [problem] = check(parse(data))
    assert problem.path == "checkpoint.dir" and f"{local}, which is node-local" in problem.message
    assert problem.fix.endswith(OPT_OUT)
    # the escape hatch, and the same layout on shared storage, are accepted
    assert check(parse(merged(data, {"checkpoint": {"ephemeral": True}}))) == []
    shared = yaml.safe_load(yaml.safe_dump(data).replace(local, "/lustre/proj"))
    assert check(parse(shared)) == []
    # a job nothing restarts, on one node, may keep them anywhere
    assert check(parse(merged(data, {"nodes": 1, "restarts": 0}))) == []
