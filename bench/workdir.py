"""`workdir:` (issue 40): what shipping the tree costs at submit, per target, and what it costs
to the first step compared with code baked into the image.

Two trees, made here: 100 small Python files (about 2 KiB each), and 50 files of 1 MiB of
random bytes (50 MiB that do not compress, like weights or data left in a tree).

Offline, every target's shipping, timed in a fresh interpreter each (no digest cache), the
median of --repeats:
  - the snapshot: walk, .gitignore rules, sha256 of every file (what render and submit read);
  - local (`run --local`) and Slurm: the content-addressed copy beside the run directory / the
    logs (bytes written = the tree);
  - Kubernetes: the deterministic tar.gz for the ConfigMap (bytes sent = its base64);
  - Docker (`run --docker`): the archive, then its unpacking into each pod's emptyDir.
With the testbeds up (--slurm: the Slurm testbed; --k8s: the Kubernetes testbed and Docker):
  - `ddpkit submit slurm` of each tree, held (`#SBATCH --hold`), whole CLI wall time, then
    cancelled; the same job without workdir beside it;
  - `ddpkit submit k8s` of each tree, in a ConfigMap (the 50 MiB one is refused: over a
    ConfigMap's 1 MiB) and as a thin image layer (`workdir.image`: built, loaded into the nodes);
  - submit to first step on Kubernetes, a 1-node job whose script prints one line: with
    workdir (ddpkit:test; ConfigMap or layer) vs the script baked into an image (`FROM` + `COPY`, built and
    loaded into the nodes first: those seconds are shown apart, they come before the submit).

Usage: python bench/workdir.py [--repeats N] [--slurm] [--k8s]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import REPO, Result, Stats  # noqa: E402

sys.path.insert(0, str(REPO))  # this tree's deploy/ and tests/, not an installed ddpkit's

IMAGE = "ddpkit:test"  # the test image (tests/conftest.py), built from this tree
SCRIPT = 'import time\nprint(f"first-step {time.time()!r}", flush=True)\n'


def make_trees(root: Path) -> dict[str, Path]:
    small, large = root / "tree-100-files", root / "tree-50mb"
    for i in range(100):
        path = small / f"pkg{i % 10}" / f"mod{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# module {i}\n" + "x = 1  # filler line of a small module\n" * 50)
    large.mkdir(parents=True)
    for i in range(50):
        (large / f"blob{i:02d}.bin").write_bytes(os.urandom(1 << 20))
    for tree in (small, large):
        (tree / "train.py").write_text(SCRIPT)
    return {"100 files": small, "50 MiB": large}


def job_file(tree: Path, name: str, **fields) -> Path:
    import yaml

    job = {"name": name, "image": IMAGE, "script": "train.py", "workdir": {"dir": ".", "max_size": "200Mi"},
           "resources": {"cpus_per_node": 0.5, "memory": "1Gi", "shm": "64Mi"}, **fields}
    path = tree / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


#: One measurement in a fresh interpreter: prints a JSON dict of seconds and bytes.
PROBE = r"""
import json, shutil, sys, tempfile, time
from pathlib import Path
from deploy import workdir
from deploy.load import load_job
from deploy.run import docker as dk
from deploy.k8s.render import render_objects
job = load_job(sys.argv[1])
out = {}
t = time.perf_counter(); snap = workdir.snapshot(job); out["snapshot_s"] = time.perf_counter() - t
out["files"], out["tree_bytes"] = len(snap.files), snap.size
dest = Path(tempfile.mkdtemp())
t = time.perf_counter(); snap.write(dest, job.name); out["copy_s"] = time.perf_counter() - t
t = time.perf_counter(); archive = snap.archive(); out["archive_s"] = time.perf_counter() - t
out["archive_bytes"], out["configmap_bytes"] = len(archive), (len(archive) + 2) // 3 * 4
objects = None
if len(archive) <= 1024 * 1024:
    objects = render_objects(job.model_copy(update={"nodes": job.nodes.model_copy(update={"min": 2, "max": 2})}), flavor="job")
    pods = dk.controller_pods(objects)
    plans = dk.plan_containers(pods, objects, dest / "run", "b0", "net", {}, {})
    dk.prepare_mounts(plans)
    import io
    t = time.perf_counter(); dk.unpack_workdirs(plans, io.StringIO()); out["docker_unpack_2pods_s"] = time.perf_counter() - t
shutil.rmtree(dest)
print(json.dumps(out))
"""


def offline(trees: dict[str, Path], repeats: int) -> dict[str, dict]:
    found = {}
    for label, tree in trees.items():
        path = job_file(tree, "bench-wd")
        runs = []
        for _ in range(repeats):
            proc = subprocess.run([sys.executable, "-c", PROBE, str(path)], cwd=tree, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
            if proc.returncode != 0:
                raise SystemExit(proc.stderr[-3000:])
            runs.append(json.loads(proc.stdout))
        found[label] = {key: (Stats([r[key] for r in runs]) if key.endswith("_s") else runs[0][key])
                        for key in runs[0]}
    return found


def ddpkit(*args: str, env: dict | None = None, cwd: Path | None = None) -> tuple[float, subprocess.CompletedProcess]:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "deploy", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, timeout=900)
    return time.perf_counter() - t, proc


def slurm_submits(trees: dict[str, Path], repeats: int) -> list[list]:
    from deploy.testbed import slurm as testbed

    was_up = testbed.status(quiet=True)
    if not was_up:
        testbed.up()
    try:
        return _slurm_submits(trees, repeats, {**testbed.client_env(), "PYTHONPATH": str(REPO)})
    finally:
        if not was_up:  # left as it was found
            testbed.down()


def _slurm_submits(trees: dict[str, Path], repeats: int, env: dict) -> list[list]:
    rows = []
    for label, tree in [("no workdir", None), *trees.items()]:
        times = []
        for i in range(repeats):
            with tempfile.TemporaryDirectory() as submit_dir:
                d = Path(submit_dir)
                if tree is None:
                    (d / "train.py").write_text(SCRIPT)
                    path = d / "job.yaml"
                    path.write_text(f"name: bench-nowd\nimage: {IMAGE}\nscript: train.py\n"
                                    "slurm: {extra_directives: [--hold]}\n")
                else:
                    path = job_file(tree, f"bench-wd{i}", slurm={"extra_directives": ["--hold"]})
                took, proc = ddpkit("submit", "slurm", str(path), env=env, cwd=d)
                if proc.returncode != 0:
                    raise SystemExit(proc.stderr[-2000:])
                subprocess.run(["scancel", proc.stdout.strip().removeprefix("slurm://")], env=env, check=False)
                times.append(took)
        rows.append([label, Stats(times).fmt(".2f", " s")])
    return rows


def k8s_figures(trees: dict[str, Path], repeats: int) -> tuple[list[list], list[list]]:
    from deploy.testbed import k8s as testbed
    from tests.conftest import docker_test_image

    was_up = testbed.status(quiet=True)
    if not was_up:
        testbed.up()
    try:
        env = {**testbed.client_env(), "PYTHONPATH": str(REPO)}
        testbed.load_image(docker_test_image(IMAGE, "ddpkit-base:bookworm"))
        return _k8s_figures(trees, repeats, env)
    finally:
        if not was_up:  # left as it was found
            testbed.down()


#: How the tree ships to Kubernetes: in a ConfigMap, or as a thin image layer loaded into the nodes.
WAYS = {"workdir (ConfigMap)": {"dir": ".", "max_size": "200Mi"},
        "workdir.image (layer)": {"dir": ".", "max_size": "200Mi", "image": "ddpkit-bench/wd"}}


def _k8s_figures(trees: dict[str, Path], repeats: int, env: dict) -> tuple[list[list], list[list]]:
    from deploy.testbed import k8s as testbed

    submits = []
    for (label, tree), (way, shipped) in itertools.product(trees.items(), WAYS.items()):
        times, outcome = [], ""
        for i in range(repeats):
            path = job_file(tree, f"bench-wd-{i}", k8s={"flavor": "job"}, workdir=shipped)
            took, proc = ddpkit("submit", "k8s", str(path), env=env)
            outcome = "submitted" if proc.returncode == 0 else proc.stderr.strip().splitlines()[-1][:120]
            if proc.returncode == 0:
                ddpkit("cancel", proc.stdout.strip(), "--wait", "60", env=env)
            times.append(took)
        submits.append([label, way, Stats(times).fmt(".2f", " s"), f"first {times[0]:.2f} s", outcome])
    first = []
    tree = trees["100 files"]
    for n, way in enumerate((*WAYS, "image")):
        before, spans = 0.0, []
        for i in range(repeats):
            name = f"bench-first-{n}-{i}"
            if way in WAYS:
                path = job_file(tree, name, k8s={"flavor": "job"}, workdir=WAYS[way])
            else:  # the script baked into an image: FROM the same image + COPY, loaded into the nodes
                own = f"ddpkit-bench-own:{i}"
                t = time.perf_counter()
                (tree / "Dockerfile").write_text(f"FROM {IMAGE}\nCOPY train.py /workspace/train.py\n")
                from deploy.image import docker_binary, docker_env
                subprocess.run([docker_binary(), "build", "-q", "-t", own, str(tree)], env=docker_env(),
                               check=True, capture_output=True, timeout=600)
                testbed.load_image(own)
                before = time.perf_counter() - t
                (tree / "Dockerfile").unlink()
                import yaml
                data = yaml.safe_load(job_file(tree, name, k8s={"flavor": "job"}).read_text())
                data.pop("workdir")
                data["image"] = own
                path = tree / "job.yaml"
                path.write_text(yaml.safe_dump(data))
            t0 = time.time()
            _, proc = ddpkit("submit", "k8s", str(path), env=env)
            if proc.returncode != 0:
                raise SystemExit(proc.stderr[-2000:])
            handle = proc.stdout.strip()
            seen = None
            deadline = time.time() + 300
            while seen is None and time.time() < deadline:
                _, logs = ddpkit("logs", handle, env=env)
                for line in logs.stdout.splitlines():
                    if "first-step " in line:
                        seen = float(line.split("first-step ", 1)[1].split()[0])
                time.sleep(0.5)
            ddpkit("cancel", handle, "--wait", "60", env=env)
            spans.append(None if seen is None else seen - t0)
            if way == "image" or way in WAYS and "image" in WAYS[way]:
                from deploy.image import docker_binary, docker_env
                from deploy.load import load_job
                from deploy.workdir import image_of

                tag = own if way == "image" else image_of(load_job(str(path)))
                testbed.remove_image(tag)  # each run's tag is new: the nodes and Docker would keep them all
                subprocess.run([docker_binary(), "rmi", tag], env=docker_env(), capture_output=True)
        first.append([way, Stats([s for s in spans if s is not None]).fmt(".1f", " s"),
                      f"{before:.1f} s" if way == "image" else "-"])
    return submits, first


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k8s-repeats", type=int, default=None, help="repeats on Kubernetes (default --repeats)")
    parser.add_argument("--slurm", action="store_true", help="also submit to the Slurm testbed (root)")
    parser.add_argument("--k8s", action="store_true", help="also submit to the Kubernetes testbed (root)")
    args = parser.parse_args()
    result = Result("workdir", "workdir: shipping the tree at submit")
    result.text("Two trees: 100 small Python files, and 50 MiB of random bytes in 50 files (they do "
                "not compress). Offline figures are each a fresh interpreter's (no digest cache).")
    with tempfile.TemporaryDirectory() as tmp:
        trees = make_trees(Path(tmp))
        found = offline(trees, args.repeats)
        rows = []
        for label, f in found.items():
            rows.append([label, f["files"], f["tree_bytes"], f["snapshot_s"].fmt(".3f", " s"),
                         f["copy_s"].fmt(".3f", " s"), f["archive_s"].fmt(".3f", " s"), f["configmap_bytes"],
                         f["docker_unpack_2pods_s"].fmt(".3f", " s") if "docker_unpack_2pods_s" in f
                         else "refused (> 1 MiB)"])
        result.table("Shipping per tree (median, spread, n): snapshot = walk + hash; local/Slurm copy the "
                     "tree; Kubernetes sends the tar.gz as base64; Docker unpacks it into each pod",
                     ["tree", "files", "bytes (local/Slurm copy)", "snapshot", "copy (local, Slurm)",
                      "tar.gz", "bytes (Kubernetes ConfigMap)", "Docker: unpack, 2 pods"], rows)
        result.doc["data"]["offline"] = found
        if args.slurm:
            result.table("`ddpkit submit slurm` wall time, held then cancelled (Slurm testbed)",
                         ["job", "submit"], slurm_submits(trees, args.repeats))
        if not args.k8s:
            result.note("Kubernetes submit times and submit to first step (workdir vs the code in the image) "
                        "need --k8s (the Kubernetes testbed, root).")
        if args.k8s:
            submits, first = k8s_figures(trees, args.k8s_repeats or args.repeats)
            result.table("`ddpkit submit k8s` wall time (Kubernetes testbed, flavor job): the tree in a "
                         "ConfigMap, or built into a thin image and loaded into the 2 nodes (the first "
                         "submit builds it; later ones find Docker's cache and the image on the nodes)",
                         ["tree", "shipped as", "submit", "first submit", "outcome"], submits)
            result.table("Submit to the script's first line, 1 pod (Kubernetes testbed)",
                         ["code", "submit to first step", "image build + load before the submit"], first)
    result.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
