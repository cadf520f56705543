"""`workdir:` the tree that ships with a job (deploy/workdir.py): which files, the content hash,
git's state, the archive, the copy, and the one-line refusals of a bad tree."""

from __future__ import annotations

import hashlib
import io
import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml

from deploy import workdir
from deploy.errors import UserError
from deploy.load import load_job
from tests.builders import job_data


def write_tree(root: Path, files: dict[str, str | bytes]) -> Path:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


def job_in(directory: Path, **fields):
    """A job file in `directory` (the workdir is relative to it), loaded as the CLI loads it."""
    path = directory / "job.yaml"
    data = {key: value for key, value in job_data(**fields).items() if key != "checkpoint"}
    path.write_text(yaml.safe_dump(data))
    return load_job(str(path))


def shipped(job) -> list[str]:
    return [f.path for f in workdir.snapshot(job).files]


def problems_of(job) -> list[str]:
    return [str(p) for p in workdir.problems(job)]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return write_tree(tmp_path / "proj", {
        "train.py": "print('v1')\n", "pkg/__init__.py": "", "pkg/model.py": "x = 1\n",
        "data/big.bin": b"\0" * 1000, "notes.log": "log\n", "keep.log": "kept\n",
        ".gitignore": "*.log\n!keep.log\n__pycache__/\n", "pkg/.gitignore": "model.py\n",
        "pkg/__pycache__/model.cpython-311.pyc": b"\1\2",
    })


# -- which files ---------------------------------------------------------------------------------


def test_the_trees_gitignore_files_and_the_jobs_excludes_leave_files_out(tree):
    job = job_in(tree.parent, workdir={"dir": "proj", "exclude": ["data/"]}, script="train.py")
    assert shipped(job) == [".gitignore", "keep.log", "pkg/.gitignore", "pkg/__init__.py", "train.py"]


def test_the_jobs_excludes_come_last_and_can_bring_a_file_back(tree):
    job = job_in(tree.parent, workdir={"dir": "proj", "exclude": ["!notes.log", "*.py", "!train.py"]},
                 script="train.py")
    assert "notes.log" in shipped(job) and "pkg/__init__.py" not in shipped(job) and "train.py" in shipped(job)


def test_git_is_never_shipped_and_the_short_form_is_the_dir(tree):
    write_tree(tree, {".git/HEAD": "ref: refs/heads/main\n"})
    job = job_in(tree, workdir=".", script="train.py")
    assert job.workdir.dir == "." and not any(p.startswith(".git/") for p in shipped(job))
    assert "job.yaml" in shipped(job)  # the job file's own directory: it ships too


def test_a_symlink_inside_the_tree_ships_as_a_relative_link(tree):
    os.symlink(tree / "train.py", tree / "main.py")  # absolute, but pointing inside
    os.symlink("pkg", tree / "lib")
    snap = workdir.snapshot(job_in(tree.parent, workdir="proj", script="main.py"))
    links = {f.path: f.link for f in snap.files if f.link}
    assert links == {"main.py": "train.py", "lib": "pkg"}


# -- the content hash ----------------------------------------------------------------------------


def test_the_hash_is_the_content_not_where_or_when(tree, tmp_path):
    job = job_in(tree.parent, workdir="proj", script="train.py")
    first = workdir.snapshot(job).digest
    copy = tmp_path / "elsewhere" / "proj"
    copy.parent.mkdir()
    subprocess.run(["cp", "-a", str(tree), str(copy)], check=True)
    os.utime(copy / "train.py", (1, 1))
    assert workdir.snapshot(job_in(copy.parent, workdir="proj", script="train.py")).digest == first
    (tree / "train.py").write_text("print('v2')\n")
    assert workdir.snapshot(job).digest != first
    (tree / "train.py").write_text("print('v1')\n")
    (tree / "train.py").chmod(0o755)  # the mode counts (as git keeps it: executable or not)
    assert workdir.snapshot(job).digest != first


def test_the_hash_covers_paths_modes_sizes_and_bytes_in_path_order(tree):
    snap = workdir.snapshot(job_in(tree.parent, workdir="proj", script="train.py"))
    expect = hashlib.sha256()
    for f in sorted(snap.files, key=lambda f: f.path):
        data = (tree / f.path).read_bytes()
        expect.update(f"{f.mode:o}\0{len(data)}\0{hashlib.sha256(data).hexdigest()}\0{f.path}\0".encode())
    assert snap.digest == expect.hexdigest()
    assert snap.describe() == f"sha256:{snap.digest[:12]}, 6 files, 1.0 KiB"


# -- git -----------------------------------------------------------------------------------------


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                   check=True, capture_output=True)


def test_git_commit_and_dirty_flag(tree):
    job = job_in(tree.parent, workdir="proj", script="train.py")
    assert workdir.snapshot(job).git is None
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "one")
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert workdir.snapshot(job).git == workdir.Git(head, False)
    (tree / "train.py").write_text("print('v2')\n")
    assert workdir.snapshot(job).git == workdir.Git(head, True)
    assert "(dirty)" in workdir.snapshot(job).describe()


# -- the archive and the copy --------------------------------------------------------------------


def test_the_archive_is_deterministic_and_unpacks_to_the_snapshot(tree, tmp_path):
    job = job_in(tree.parent, workdir="proj", script="train.py")
    snap = workdir.snapshot(job)
    data = snap.archive()
    workdir._ARCHIVES.clear()
    (tree / "train.py").touch()
    assert workdir.snapshot(job).archive() == data  # times are not in it
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == [f.path for f in snap.files]
        assert {(m.uid, m.gid, m.uname, m.mtime) for m in members} == {(0, 0, "", workdir.ARCHIVE_MTIME)}
        tar.extractall(tmp_path / "out", filter="data")
    assert (tmp_path / "out" / "train.py").read_text() == "print('v1')\n"


def test_the_copy_is_content_addressed_and_whole(tree, tmp_path):
    snap = workdir.snapshot(job_in(tree.parent, workdir="proj", script="train.py"))
    dest, written = snap.write(tmp_path / "logs", "demo")
    assert written and dest.name == f"demo-workdir-{snap.short}"
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == \
        [f.path for f in snap.files]
    assert snap.write(tmp_path / "logs", "demo") == (dest, False)
    assert [p.name for p in (tmp_path / "logs").iterdir()] == [dest.name]  # no temporary left


def test_a_file_edited_while_shipping_stops_the_copy(tree, tmp_path):
    snap = workdir.snapshot(job_in(tree.parent, workdir="proj", script="train.py"))
    (tree / "train.py").write_text("print('edited')\n")
    with pytest.raises(workdir.RuntimeFailure, match="train.py changed while it was being shipped"):
        snap.write(tmp_path / "logs", "demo")
    assert list((tmp_path / "logs").iterdir()) == []


# -- bad trees: one line each, naming the field and the fix -------------------------------------


def test_a_missing_directory(tmp_path):
    job = job_in(tmp_path, workdir="nope", script="train.py")
    [line] = problems_of(job)
    assert line.startswith(f"workdir.dir: {tmp_path / 'nope'}: no such directory; give a directory "
                           "relative to the job file's")
    with pytest.raises(UserError) as err:
        workdir.snapshot(job)
    assert err.value.problems[0].startswith(f"{tmp_path / 'job.yaml'}:")  # where the field is written


def test_a_tree_over_the_limit_names_its_largest_files(tree):
    job = job_in(tree.parent, workdir={"dir": "proj", "max_size": "512"}, script="train.py")
    [line] = problems_of(job)
    assert "workdir.max_size: the tree" in line and "over 512 B; the largest: data/big.bin (1000 B)" in line
    assert line.endswith("raise workdir.max_size")


def test_a_symlink_that_leaves_the_tree(tree, tmp_path):
    (tmp_path / "secret.txt").write_text("s")
    os.symlink(tmp_path / "secret.txt", tree / "outside.txt")
    [line] = problems_of(job_in(tree.parent, workdir="proj", script="train.py"))
    assert line.startswith(f"workdir.dir: outside.txt is a symlink to {tmp_path / 'secret.txt'}, outside the tree")
    assert "workdir.exclude: [outside.txt]" in line


@pytest.mark.parametrize("script, why", [("missing.py", "no such file"),
                                         ("notes.log", "is left out by .gitignore or workdir.exclude")])
def test_a_script_that_is_not_in_the_snapshot(tree, script, why):
    [line] = problems_of(job_in(tree.parent, workdir="proj", script=script))
    assert line.startswith(f"script: {script}: {why} in workdir {tree}")


def test_a_script_outside_the_tree_is_refused_by_the_model(tmp_path):
    with pytest.raises(UserError, match=r"script: \.\./train\.py is outside workdir '\.'"):
        job_in(tmp_path, workdir=".", script="../train.py")


# -- run --local: the snapshot, not the live tree ------------------------------------------------

SHOW = """import os, pathlib, sys
print("version", open("VERSION").read().strip(), "in", os.getcwd(), flush=True)
print("env", os.environ.get("DDPKIT_WORKDIR_HASH"), os.environ.get("DDPKIT_WORKDIR_DIRTY"), flush=True)
pathlib.Path("out.txt").write_text("written")
"""


@pytest.mark.slow
def test_run_local_runs_a_copy_of_the_tree_not_the_tree(tmp_path):
    from tests.conftest import ddpkit

    tree = write_tree(tmp_path / "proj", {"train.py": SHOW, "VERSION": "v1\n", "big/x": "x"})
    (tree / "job.yaml").write_text(yaml.safe_dump({"name": "wd", "image": "img:1", "script": "train.py",
                                                   "workdir": {"dir": ".", "exclude": ["big/"]}}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = ddpkit("run", str(tree / "job.yaml"), "--local", cwd=elsewhere, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    snap = workdir.snapshot(load_job(str(tree / "job.yaml")))
    copy = elsewhere / "runs" / f"wd-workdir-{snap.short}"
    assert f"version v1 in {copy}" in result.stdout
    assert f"env {snap.digest} None" in result.stdout  # not a git work tree: no commit, no flag
    assert f"workdir {tree} (sha256:{snap.short}, 3 files," in result.stderr
    assert (copy / "out.txt").read_text() == "written" and not (tree / "out.txt").exists()
    assert not (copy / "big").exists() and (elsewhere / "runs" / "wd" / "job.yaml").exists()
    why = ddpkit("why", "runs/wd", cwd=elsewhere)  # the launcher's record says what it ran
    assert why.returncode == 0 and why.stdout.splitlines()[-1] == f"  workdir sha256:{snap.digest}", why.stdout


# -- Slurm: the script runs in the snapshot beside the logs --------------------------------------


def slurm_job(tree: Path, **fields):
    (tree / "job.yaml").write_text(yaml.safe_dump({"name": "wd", "image": "img:1", "script": "train.py",
                                                   "workdir": ".", **fields}))
    return load_job(str(tree / "job.yaml"))


def test_the_sbatch_script_cds_into_the_snapshot_named_by_its_hash(tree):
    from deploy.slurm.render import render_slurm

    job = slurm_job(tree)
    snap = workdir.snapshot(job)
    script = render_slurm(job, source="job.yaml")
    assert f'workdir="$log_dir"/wd-workdir-{snap.short}\n' in script
    assert '\ncd "$workdir"\n' in script and f"export DDPKIT_WORKDIR_HASH={snap.digest}\n" in script
    assert f"\necho 'ddpkit: workdir sha256:{snap.digest}'\n" in script  # what status and why read
    # before anything reads a relative path (the FINISHED marker, the job file beside the logs)
    assert script.index('cd "$workdir"') < script.index("finished_marker=") < script.index("job_dir=")
    assert render_slurm(job, source="job.yaml") == script  # a function of the job file and the tree
    (tree / "train.py").write_text("print('v2')\n")
    assert render_slurm(job, source="job.yaml") != script


def test_ddpkits_own_outputs_in_the_tree_are_not_shipped(tree, monkeypatch):
    monkeypatch.chdir(tree)
    job = slurm_job(tree)
    before = workdir.snapshot(job).digest
    write_tree(tree, {"logs/wd-12.out": "x", "runs/wd/metrics.jsonl": "{}"})
    assert workdir.snapshot(job).digest == before


def test_submit_ships_the_snapshot_before_sbatch_and_dry_run_ships_nothing(tree, tmp_path, capsys):
    from deploy.slurm import submit as slurm
    from tests.test_slurm_submit import FakeSlurm

    job = slurm_job(tree)
    snap = workdir.snapshot(job)
    copy = tmp_path / "submit" / "logs" / f"wd-workdir-{snap.short}"
    seen = []
    fake = FakeSlurm(sbatch=lambda argv: (seen.append(copy.is_dir()), (0, "12\n", ""))[1])
    assert slurm.submit(job, runner=fake, cwd=tmp_path / "submit", dry_run=True) == "12"
    assert seen == [False] and not copy.exists()
    assert f"ddpkit: would ship workdir {tree} ({snap.describe()}) to {copy}" in capsys.readouterr().err
    assert slurm.submit(job, runner=fake, cwd=tmp_path / "submit") == "slurm://12"
    assert seen == [False, True] and (copy / "train.py").read_text() == "print('v1')\n"
    assert f"ddpkit: shipped: workdir {tree} ({snap.describe()}) in {copy}" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["missing", "too big", "symlink out", "script outside"])
def test_a_bad_tree_is_one_line_exit_2_and_nothing_shipped(tmp_path, case):
    from tests.conftest import ddpkit

    tree = write_tree(tmp_path / "proj", {"train.py": "print(1)\n", "data.bin": b"\0" * 4096})
    fields = {"workdir": {"dir": ".", "max_size": "1Ki"} if case == "too big" else "."}
    if case == "missing":
        fields["workdir"] = "nope"
    if case == "symlink out":
        (tmp_path / "outside.txt").write_text("x")
        os.symlink(tmp_path / "outside.txt", tree / "link.txt")
    if case == "script outside":
        fields["script"] = "../train.py"
    (tree / "job.yaml").write_text(yaml.safe_dump({"name": "wd", "image": "img:1", "script": "train.py", **fields}))
    field = {"missing": "workdir.dir", "too big": "workdir.max_size", "symlink out": "workdir.dir",
             "script outside": "script"}[case]
    for argv in (["submit", "slurm"], ["submit", "k8s", "--dry-run"], ["render", "slurm"], ["run", "--local"]):
        args = [*argv[:2], str(tree / "job.yaml"), *argv[2:]] if argv[0] != "run" else \
            ["run", str(tree / "job.yaml"), "--local"]
        result = ddpkit(*args, cwd=tmp_path)
        assert result.returncode == 2, (argv, result.stderr)
        [line] = result.stderr.splitlines()
        assert line.startswith(f"error: {tree / 'job.yaml'}:") and f": {field}: " in line, line
        assert "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside.txt", "proj"][case != "symlink out":]
    assert not (tree / "logs").exists() and not (tree / "runs").exists()


# -- Kubernetes: the archive in a ConfigMap, unpacked into the pods' working directory ----------


def k8s_objects(job, flavor: str) -> list[dict]:
    from deploy.targets import REGISTRY

    return REGISTRY["k8s"].request(job, flavor=flavor)  # lint's refusals included: none


def pod_specs(objects: list[dict]) -> list[dict]:
    """Every pod template spec of the workload (the TrainJob's runtime patch for a TrainJob)."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            if "containers" in node and isinstance(node["containers"], list):
                found.append(node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(objects[-1])
    return found


@pytest.mark.parametrize("flavor", ["pytorchjob", "trainjob", "jobset", "job"])
def test_every_flavor_unpacks_the_archive_into_its_working_directory(tree, flavor, tmp_path):
    import base64

    from deploy.k8s import pod as podlib

    job = slurm_job(tree, nodes=2)
    snap = workdir.snapshot(job)
    objects = k8s_objects(job, flavor)
    [cm] = [o for o in objects if o["metadata"]["name"] == "wd-workdir"]
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["annotations"] == {workdir.HASH_ANNOTATION: snap.digest}
    assert base64.b64decode(cm["binaryData"][podlib.WORKDIR_KEY]) == snap.archive()
    assert objects.index(cm) == 1  # after the job file's, before the workload
    for spec in pod_specs(objects):
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["ddpkit-workdir"] == {"name": "ddpkit-workdir", "emptyDir": {}}
        assert volumes["ddpkit-workdir-archive"]["configMap"] == {"name": "wd-workdir"}
        main = spec["containers"][0]
        assert {"name": "ddpkit-workdir", "mountPath": "/workdir"} in main["volumeMounts"]
        if flavor == "trainjob":  # runtimePatches add no init container: the trainer unpacks
            assert "initContainers" not in spec and podlib.WORKDIR_ARCHIVE_MOUNT in main["volumeMounts"]
            continue
        assert main["workingDir"] == "/workdir"
        init = spec["initContainers"][0]
        assert init["name"] == "ddpkit-workdir" and init["image"] == "img:1"
        assert init["command"] == ["python", "-c", podlib.UNPACK, "/etc/ddpkit-workdir/workdir.tar.gz", "/workdir"]
        assert {"name": "DDPKIT_WORKDIR_HASH", "value": snap.digest} in main["env"]
    if flavor == "trainjob":
        trainer = objects[-1]["spec"]["trainer"]
        assert trainer["command"] == ["python", "-c", podlib.UNPACK, "/etc/ddpkit-workdir/workdir.tar.gz",
                                      "/workdir", "python", "-m", "trainer.launch"]
        assert {"name": "DDPKIT_WORKDIR_HASH", "value": snap.digest} in trainer["env"]


def test_the_unpack_code_unpacks_and_then_runs_in_the_tree(tree, tmp_path):
    from deploy.k8s import pod as podlib

    snap = workdir.snapshot(slurm_job(tree))
    (tmp_path / "a.tar.gz").write_bytes(snap.archive())
    import sys

    result = subprocess.run([sys.executable, "-c", podlib.UNPACK, str(tmp_path / "a.tar.gz"), str(tmp_path / "w"),
                             sys.executable, "train.py"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "DDPKIT_WORKDIR_HASH": snap.digest})
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"ddpkit: workdir sha256:{snap.short}: {len(snap.files)} files in {tmp_path / 'w'}\nv1\n"


def test_a_tree_a_configmap_cannot_carry_is_refused_naming_the_fix(tree):
    from deploy.targets import REGISTRY

    (tree / "noise.bin").write_bytes(os.urandom(1100 * 1024))  # does not compress
    job = slurm_job(tree)
    [problem] = REGISTRY["k8s"].check(job)
    assert problem.path == "workdir" and "over the 1.0 MiB a ConfigMap can carry" in problem.message
    assert "workdir.exclude" in problem.fix
    assert REGISTRY["slurm"].check(job) == []  # Slurm copies any tree within max_size


@pytest.mark.parametrize("flavor", ["pytorchjob", "trainjob", "jobset", "job"])
def test_with_workdir_image_every_flavor_runs_the_trees_image_and_no_configmap(tree, flavor):
    """`workdir.image`: the training container's image is the thin layer's tag (the hash of the
    tree and of the base image), no ConfigMap, no unpacking; the record of the tree stays."""
    import yaml

    (tree / "noise.bin").write_bytes(os.urandom(1100 * 1024))  # over a ConfigMap: fine as an image
    job = slurm_job(tree, nodes=2, workdir={"dir": ".", "image": "registry.example:5000/team/wd"})
    snap = workdir.snapshot(job)
    tag = snap.image("registry.example:5000/team/wd", "img:1")
    assert re.fullmatch(r"registry\.example:5000/team/wd:workdir-[0-9a-f]{12}", tag)
    assert tag != snap.image("registry.example:5000/team/wd", "img:2")  # another base, another tag
    objects = k8s_objects(job, flavor)
    assert [o for o in objects if o["metadata"]["name"] == "wd-workdir"] == []
    text = yaml.safe_dump(objects)
    assert "ddpkit-workdir" not in text and "workdir.tar.gz" not in text
    images = {c["image"] for spec in pod_specs(objects) for c in spec["containers"] if "image" in c}
    if flavor == "trainjob":
        assert objects[-1]["spec"]["trainer"]["command"] == ["python", "-m", "trainer.launch"]
        images.add(objects[-1]["spec"]["trainer"]["image"])
    assert images == {tag}, images
    for spec in pod_specs(objects):
        main = spec["containers"][0]
        assert {"name": "DDPKIT_WORKDIR_HASH", "value": snap.digest} in (main.get("env") or
                                                                         objects[-1]["spec"]["trainer"]["env"])


def test_workdir_image_must_be_a_repository():
    from pydantic import ValidationError

    from deploy.spec import Workdir

    assert Workdir(dir=".", image="registry.example:5000/team/wd").image == "registry.example:5000/team/wd"
    for bad in ("team/wd:1.0", "Team/wd", "team/wd@sha256:0", "a b"):
        with pytest.raises(ValidationError, match="not an image repository"):
            Workdir(dir=".", image=bad)


def test_submit_builds_the_trees_image_before_any_object_and_dry_run_builds_nothing(tree, capsys, monkeypatch):
    from deploy import image as images
    from deploy.k8s import submit as k8s_submit
    from tests.test_k8s_submit import FakeCluster

    job = slurm_job(tree, workdir={"dir": ".", "image": "registry.example:5000/team/wd"})
    tag = workdir.image_of(job)
    monkeypatch.delenv("KUBECONFIG", raising=False)  # not the testbed: the image is pushed
    cluster, calls = FakeCluster(), []
    monkeypatch.setattr(images, "build_workdir_image",
                        lambda base, snap, t: calls.append(("build", base, snap.digest, t, len(cluster.objects))) or 1.0)
    monkeypatch.setattr(images, "push", lambda t: calls.append(("push", t)) or 2.0)
    k8s_submit.submit(job, dry_run=True, cluster=cluster)
    assert calls == [] and f"would ship: workdir {tree} " in capsys.readouterr().err
    k8s_submit.submit(job, cluster=cluster)
    assert calls == [("build", "img:1", workdir.snapshot(job).digest, tag, 0), ("push", tag)]
    assert f"ddpkit: workdir image {tag}: built in 1.0s, pushed in 2.0s" in capsys.readouterr().err


def test_submit_says_what_it_ships_and_the_workload_owns_the_configmap(tree, capsys):
    from deploy.k8s import submit as k8s_submit
    from tests.test_k8s_submit import FakeCluster

    job = slurm_job(tree)
    cluster = FakeCluster()
    k8s_submit.submit(job, dry_run=True, cluster=cluster)
    snap = workdir.snapshot(job)
    assert f"ddpkit: would ship: workdir {tree} ({snap.describe()}) as a " in capsys.readouterr().err
    handle = k8s_submit.submit(job, cluster=cluster)
    assert "ddpkit: shipped: workdir" in capsys.readouterr().err
    assert handle == "k8s://default/pytorchjob/wd"
    owners = cluster.objects[("ConfigMap", "default", "wd-workdir")]["metadata"]["ownerReferences"]
    assert [(o["kind"], o["name"]) for o in owners] == [("PyTorchJob", "wd")]  # deleted with it


# -- run --docker: the pods as the cluster would run them ----------------------------------------


@pytest.mark.parametrize("flavor", ["pytorchjob", "trainjob", "jobset", "job"])
def test_docker_pods_get_the_snapshot_as_their_working_directory(tree, tmp_path, flavor):
    import io as _io

    from deploy.k8s import pod as podlib
    from deploy.k8s.render import render_objects
    from deploy.run import docker as dk

    job = slurm_job(tree, nodes=2)
    snap = workdir.snapshot(job)
    objects = render_objects(job, flavor=flavor)
    pods = dk.controller_pods(objects)
    plans = dk.plan_containers(pods, objects, tmp_path / "run", "t0", "net0", {}, {})
    dk.prepare_mounts(plans)
    out = _io.StringIO()
    dk.unpack_workdirs(plans, out)
    for plan in plans:
        mounts = {m.target: m for m in plan.mounts}
        local = mounts["/workdir"].source
        assert local == tmp_path / "run" / "pods" / plan.pod.name / "ddpkit-workdir"  # each pod its own
        if flavor == "trainjob":  # the container unpacks (its command), as on the cluster
            assert plan.unpack is None and plan.argv[:2] == ["-c", podlib.UNPACK]
            assert (mounts["/etc/ddpkit-workdir"].source / "workdir.tar.gz").read_bytes() == snap.archive()
            continue
        assert (local / "train.py").read_text() == "print('v1')\n"
        assert sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if not p.is_dir()) == \
            [f.path for f in snap.files]
        args = plan.create_args
        assert args[args.index("--workdir") + 1] == "/workdir"
    if flavor != "trainjob":
        assert out.getvalue().count(f"ddpkit: workdir sha256:{snap.short}: {len(snap.files)} files in ") == 2


# -- records: what a run ran, in status --json and why ------------------------------------------


def test_the_record_as_a_log_line_and_back():
    from trainer import contract

    env = {"DDPKIT_WORKDIR_HASH": "a" * 64, "DDPKIT_WORKDIR_COMMIT": "b" * 40, "DDPKIT_WORKDIR_DIRTY": "1"}
    record = contract.workdir_record(env)
    assert record == {"sha256": "a" * 64, "commit": "b" * 40, "dirty": True}
    line = contract.workdir_line(record)
    assert line == f"workdir sha256:{'a' * 64} git {'b' * 40} (dirty)"
    assert contract.parse_workdir_line(f"[0/-] ddpkit launch: {line} in /workdir\n") == record
    outside = contract.workdir_record({"DDPKIT_WORKDIR_HASH": "c" * 64})  # not a git work tree
    assert outside == {"sha256": "c" * 64, "commit": None, "dirty": None}
    assert contract.parse_workdir_line(contract.workdir_line(outside)) == outside
    assert contract.workdir_record({}) is None and contract.parse_workdir_line("no such line") is None


def test_status_json_and_why_show_the_tree_a_kubernetes_job_runs(tree):
    from deploy.k8s import submit as k8s_submit
    from deploy.progress import Report
    from deploy.why import explain
    from tests.test_k8s_submit import FakeCluster

    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "one")
    job = slurm_job(tree)
    (tree / "train.py").write_text("print('v2')\n")  # edited after the commit: dirty
    snap = workdir.snapshot(job)
    for flavor in ("pytorchjob", "trainjob"):
        cluster = FakeCluster()
        k8s_submit.submit(job, flavor=flavor, cluster=cluster)
        obj = cluster.objects[(objects := k8s_objects(job, flavor))[-1]["kind"], "default", "wd"]
        expect = {"sha256": snap.digest, "commit": snap.git.commit, "dirty": True}
        assert k8s_submit.workdir_of(obj) == expect, flavor
        assert Report("RUNNING", workdir=expect).as_json("k8s://x")["workdir"] == expect
    lines = explain("FAILED", "", None, workdir=expect)
    assert lines[-1] == f"  workdir sha256:{snap.digest} git {snap.git.commit} (dirty)"
    assert objects  # rendered once more, for the kind


def test_slurm_status_and_why_read_the_line_the_batch_script_prints_first(tree, tmp_path):
    from deploy.slurm import submit as slurm
    from tests.test_slurm_submit import FakeSlurm, scontrol_line

    snap = workdir.snapshot(slurm_job(tree))
    log = tmp_path / "wd-12.out"
    log.write_text(f"ddpkit: workdir sha256:{snap.digest}\n" + "noise\n" * 20000)
    fake = FakeSlurm(scontrol=(0, scontrol_line("RUNNING", stdout=str(log)), ""))
    report = slurm.report("slurm://12", runner=fake)
    assert report.as_json("slurm://12")["workdir"] == {"sha256": snap.digest, "commit": None, "dirty": None}
    assert slurm.why("slurm://12", runner=fake)[-1] == f"  workdir sha256:{snap.digest}"


@pytest.mark.slow
def test_a_trainer_run_from_a_workdir_shows_it_in_status_json(tmp_path):
    import json

    from tests.conftest import ddpkit

    tree = write_tree(tmp_path / "proj", {"notes.txt": "the tree\n"})
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "one")
    (tree / "job.yaml").write_text(yaml.safe_dump({
        "name": "wdt", "image": "img:1", "workdir": ".", "checkpoint": {"ephemeral": True},
        "train": {"max_steps": 2, "data_samples": 256, "batch_size": 32, "plot": False, "eval_every_epochs": 0}}))
    result = ddpkit("run", str(tree / "job.yaml"), "--local", cwd=tmp_path, env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    status = ddpkit("status", "runs/wdt", "--json", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    snap = workdir.snapshot(load_job(str(tree / "job.yaml")))
    assert json.loads(status.stdout)["workdir"] == {"sha256": snap.digest, "commit": snap.git.commit,
                                                     "dirty": True}  # job.yaml is not committed


def test_validate_says_which_tree_would_ship(tree):
    from tests.conftest import cli

    job = slurm_job(tree)
    snap = workdir.snapshot(job)
    result = cli("validate", str(tree / "job.yaml"))
    assert result.returncode == 0, result.stderr
    assert f"runs train.py from workdir {tree} ({snap.describe()}); checked for" in result.stdout
