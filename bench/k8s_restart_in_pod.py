"""A rank killed inside a running pod on the Kubernetes testbed: kill -> the next attempt's first
step, warm restarts (the node's template forks the workers, trainer/warm.py) against cold ones
(`train.warm_restarts: false`: every worker imports torch again), side by side in one run.

The flavors whose pods restart their workers in place, without a new pod: TrainJob (`restarts:
N` is torchrun's `--max-restarts N` in every pod, Trainer v2's torch plugin) and an elastic
PyTorchJob (`nodes: MIN:MAX`). A 2-node quickstart (one pod per node, 2 ranks a pod) trains past
step 30; then `kill -9` of one rank's process on node rank 1 (from `kubectl exec`, the way a
segfault or an OOM kill of one process looks); the agents of both pods restart their workers,
which rendezvous again, load the newest checkpoint and train. Timed from the kill to the moment
rank 0 records the new attempt's first step (RUN_DIR/attempts/attempt-N.step gets its first
step count; polled every 50 ms). Kills per setting: --kills (one job per setting, killed that many times, waiting
for each new attempt's first step).

Needs root, the testbed up with 2 or more nodes and the image loaded.
Usage: python bench/k8s_restart_in_pod.py [--image ddpkit:test] [--flavors trainjob] [--kills 3]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_common import Result, fmt  # noqa: E402
from bench.k8s_node_loss import INSTANCE, NODE_RANK_1, bench_args, kubectl, steps_logged, wait  # noqa: E402
from bench.k8s_testbed import ddpkit, job_file  # noqa: E402
from deploy.k8s import flavor as flavor_module  # noqa: E402

#: run in the pod: SIGKILL one rank's process (a forked worker is named ddpkit-rank<R>; a cold
#: one runs trainer.train); prints its pid
KILL_ONE_RANK = """
import os, signal
for pid in sorted(filter(str.isdigit, os.listdir('/proc')), key=int):
    try:
        comm = open(f'/proc/{pid}/comm').read().strip()
        cmd = open(f'/proc/{pid}/cmdline', 'rb').read()
        env = open(f'/proc/{pid}/environ', 'rb').read()
    except OSError:
        continue
    if comm.startswith('ddpkit-rank') or (b'trainer.train' in cmd and b'DDPKIT_WARM_SOCKET' not in env):
        os.kill(int(pid), signal.SIGKILL); print(pid); break
"""


def rank_1_pod(env: dict, name: str, flavor: str) -> str:
    key, value = NODE_RANK_1[flavor]
    for pod in json.loads(kubectl(env, "get", "pods", "-l", f"{INSTANCE}={name}", "-o", "json"))["items"]:
        meta = pod["metadata"]
        if not meta.get("deletionTimestamp") and {**meta.get("labels", {}), **meta.get("annotations", {})}.get(key) == value:
            return meta["name"]  # not a pod of an earlier job of that name, still going
    raise RuntimeError(f"{name}: no pod of node rank 1")


def submit(flavor: str, warm: bool, image: str, env: dict, tmp: Path, kills: int) -> tuple[str, Path]:
    out = tmp / f"{flavor}-{'warm' if warm else 'cold'}"
    out.mkdir()
    os.chmod(out, 0o777)  # the image runs as uid 1000
    name = f"bench-inpod-{flavor}-{'warm' if warm else 'cold'}"
    path = job_file(tmp, name, image, flavor)
    job = yaml.safe_load(path.read_text())
    job["restarts"] = kills + 1
    job.get("slurm", {}).pop("requeue", None)
    job["volumes"] = [{"name": "out", "mount": "/out", "host_path": str(out)}]
    job["train"].update(output_dir="/out", max_steps=100000, epochs=1000, warm_restarts=warm)
    job["k8s"]["one_pod_per_node"] = True
    if flavor == "pytorchjob":
        job["nodes"] = "1:2"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    proc = ddpkit("submit", "k8s", str(path), env=env)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr)
    return proc.stdout.strip(), out / name


def kill_and_time(env: dict, handle: str, run_dir: Path, flavor: str, attempt: int) -> float:
    name = handle.rsplit("/", 1)[1]
    pod = rank_1_pod(env, name, flavor)
    container = flavor_module(flavor).CONTAINER
    wait(f"attempt {attempt - 1} past 20 steps", lambda: steps_logged(run_dir) >= 30 * attempt)
    killed = time.monotonic()
    kubectl(env, "exec", pod, "-c", container, "--", "python", "-c", KILL_ONE_RANK)
    step_file = run_dir / "attempts" / f"attempt-{attempt}.step"
    looked = killed  # whether the job ended: every 10 s (a `ddpkit status` costs a process)
    while not (step_file.exists() and step_file.stat().st_size > 0):  # written after the first step
        if time.monotonic() - looked > 10:
            looked = time.monotonic()
            ended = looked - killed > 300 or ddpkit("status", handle, env=env).stdout.startswith("FAILED")
        else:
            ended = False
        if ended:
            why = ddpkit("why", handle, env=env).stdout.splitlines()
            raise RuntimeError(f"{handle} ended before attempt {attempt}'s first step: {why[0] if why else '?'}")
        time.sleep(0.05)
    return time.monotonic() - killed


def main() -> None:
    args, env = bench_args(__doc__, "trainjob", kills=3)
    res = Result("k8s_restart_in_pod", "k8s testbed: a rank killed inside a running pod, warm vs cold restarts")
    rows, runs = [], []
    with tempfile.TemporaryDirectory(prefix="ddpkit-inpod-") as tmp:
        os.chmod(tmp, 0o755)
        for flavor in args.flavors.split(","):
            for warm in (True, False):
                handle, run_dir = submit(flavor, warm, args.image, env, Path(tmp), args.kills)
                times = []
                try:
                    for kill in range(1, args.kills + 1):
                        times.append(kill_and_time(env, handle, run_dir, flavor, kill))
                except RuntimeError as err:  # the figures so far stand; the failure is reported
                    res.note(f"{flavor} {'warm' if warm else 'cold'}: {err}")
                finally:
                    ddpkit("cancel", handle, "--wait", "120", env=env)
                if not times:
                    continue
                print(json.dumps({"flavor": flavor, "warm": warm, "kill_to_first_step_s": times}), flush=True)
                runs.append({"flavor": flavor, "warm": warm, "kill_to_first_step_s": times})
                rows.append([flavor, "warm" if warm else "cold", fmt(statistics.median(times)),
                             f"{min(times):.2f}-{max(times):.2f}", len(times)])
    res.text("`kill -9` of one rank's process in node rank 1's pod (2 pods x 2 ranks); both pods' "
             "torchrun agents restart their workers in place (no new pod), which rendezvous, load "
             "the newest checkpoint and train; timed to the new attempt's first step.")
    res.table("kill -> the next attempt's first step inside running pods",
              ["flavor", "restart", "kill -> first step s (median)", "range", "kills"], rows)
    res.doc["data"]["runs"] = runs
    res.save()

if __name__ == "__main__":
    main()
