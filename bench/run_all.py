"""`make bench`: run every bench script with settings that fit ~20 minutes, then the report.

Each script prints its figures and writes `bench/report/results/<name>.json`; a script that
needs a testbed that is down, or root, gets a "skipped" result that says why, and one that fails
a "failed" result with the end of its output, so one missing testbed never loses the others'
figures. At the end `bench/report.py` writes `bench/report/BENCHMARKS.md` and the charts.

    python bench/run_all.py [--only NAME...] [--skip NAME...] [--up] [--quick | --light] [--timeout-scale F]

`--up` brings up the Docker and Slurm testbeds when they are down (root) and takes down again
only the ones it brought up. `--quick` runs every script with tiny settings (a smoke test of
the whole pipeline, figures meaningless); `--light` fewer repeats and steps, for a machine
other work shares (the report says which settings ran: each section shows its command).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_common import REPO, Result, is_root, load_average, results_dir  # noqa: E402

# name, script, full arguments, light arguments (a loaded machine), timeout (s) with full arguments
SCRIPTS = [
    ("trainer_vs_textbook", "trainer_vs_textbook.py", ["--steps", "200", "--repeats", "3"],
     ["--steps", "120", "--repeats", "2"], 420),
    ("dp_vs_ddp", "dp_vs_ddp.py", ["--steps", "60", "--repeats", "2"], ["--steps", "30", "--repeats", "2"], 300),
    ("step_profile", "step_profile.py", ["--steps", "50", "--repeats", "2"], ["--steps", "40", "--repeats", "2"], 420),
    ("launch_time", "launch_time.py", ["--repeats", "3"], ["--repeats", "2"], 240),
    # 2 local ranks with the hang watchdog on and off, interleaved (400-step runs differed by
    # -32% to +10% from noise alone here): ~10 min
    ("watchdog_overhead", "watchdog_overhead.py", ["--rounds", "6", "--steps", "1000"],
     ["--rounds", "4", "--steps", "600"], 1500),
    # kill -> next first step, cold vs warm restarts (trainer/warm.py): ~4 min here
    ("restart_time", "launch_time.py", ["--kills", "6"], ["--kills", "5"], 600),
    ("checkpoint_save", "checkpoint_save.py", ["--repeats", "5"], ["--repeats", "3"], 240),
    # your own script: the step hook's cost (~2 min), hang detection and stop times (~2.5 min)
    ("script_steps", "script_steps.py", ["--repeats", "5", "--steps", "600"], ["--repeats", "3", "--steps", "400"], 420),
    ("script_hangs", "script_hangs.py", ["--repeats", "3"], ["--repeats", "2"], 600),
    # a script's lines through the [rankR]: relay vs straight (~10 s)
    ("rank_lines", "rank_lines.py", ["--repeats", "5"], ["--repeats", "3"], 300),
    ("resize", "resize.py", ["--steps", "5"], ["--steps", "3"], 420),
    ("render_speed", "render_speed.py", ["--repeats", "7", "--instructions"], ["--repeats", "7", "--instructions"], 420),
    ("lint_speed", "lint_speed.py", ["--repeats", "5"], ["--repeats", "1"], 120),
    ("docker", "docker.py", [], [], 600),
    # workdir: shipping per tree and target offline, submit times on the testbeds, first step
    # with workdir vs the code in the image on Kubernetes (~10 min with --k8s)
    ("workdir", "workdir.py", ["--repeats", "3", "--slurm", "--k8s", "--k8s-repeats", "2"],
     ["--repeats", "2", "--slurm"], 1500),
    ("slurm_testbed", "slurm_testbed.py", ["--repeats", "1"], ["--repeats", "1"], 600),
    # a rank killed inside a running Slurm job, in the step (warm, cold) and a new step: ~4 min
    ("slurm_restart_in_step", "slurm_restart_in_step.py", ["--kills", "3"], ["--kills", "2"], 900),
    ("k8s_testbed", "k8s_testbed.py", ["--runs", "1"], ["--runs", "1"], 900),
    # a queued job's admission once capacity frees, per flavor (Kueue on the testbed): ~3 min
    ("kueue_admission", "kueue_admission.py", ["--runs", "3"], ["--runs", "2"], 600),
    # a node killed mid-run per flavor (~8 min), and a rank killed inside running pods, warm vs
    # cold (~9 min): the testbed up with 2+ nodes and the test image loaded
    ("k8s_node_loss", "k8s_node_loss.py", [], ["--flavors", "job,pytorchjob"], 1200),
    ("k8s_restart_in_pod", "k8s_restart_in_pod.py", ["--flavors", "trainjob,pytorchjob", "--kills", "3"],
     ["--flavors", "trainjob", "--kills", "2"], 1200),
    # one checkpoint interval (a fault run on the cold path, one on the warm path and a
    # calibration: ~4 min here); `python bench/goodput.py --warm` alone kills every 60 s (~15 min)
    ("goodput", "goodput.py", ["--train-s", "60", "--fault-every", "30", "--intervals", "20", "--warm"],
     ["--train-s", "45", "--fault-every", "20", "--intervals", "20", "--warm"], 600),
]
QUICK = {"trainer_vs_textbook": ["--steps", "30", "--repeats", "1"], "dp_vs_ddp": ["--steps", "10", "--repeats", "1"],
         "step_profile": ["--steps", "8", "--repeats", "1"], "launch_time": ["--repeats", "1"],
         "watchdog_overhead": ["--rounds", "1", "--steps", "60"],
         "restart_time": ["--kills", "2"],
         "checkpoint_save": ["--repeats", "1", "--small"], "render_speed": ["--repeats", "2"],
         "lint_speed": ["--repeats", "1"], "resize": ["--steps", "2", "--ranks", "1", "2"],
         "goodput": ["--train-s", "20", "--fault-every", "10", "--warm"]}


def skip_reason(name: str) -> str | None:
    """Why a script cannot run here right now (None: it can)."""
    if not (HERE / dict((n, s) for n, s, *_ in SCRIPTS)[name]).exists():
        return f"bench/{dict((n, s) for n, s, *_ in SCRIPTS)[name]} does not exist yet"
    if name == "docker":
        from deploy.image import image_exists
        from deploy.testbed import docker

        if not docker.daemon_up():
            return "the Docker testbed is down (`sudo ddpkit testbed docker up`, or `make bench BENCH_UP=1`)"
        if not image_exists(docker.BASE_IMAGE):
            return f"the Docker daemon has no {docker.BASE_IMAGE} base image (`sudo ddpkit testbed docker up`)"
    if name in ("k8s_node_loss", "k8s_restart_in_pod"):
        from deploy.testbed import k8s

        if len(k8s.node_sockets()) < 2:
            return "the Kubernetes testbed is not up with 2+ nodes (`sudo ddpkit testbed k8s up`, image loaded)"
    if name == "slurm_restart_in_step":
        from deploy.testbed import slurm

        if not is_root() or not slurm.status(quiet=True):
            return "the Slurm testbed is not up (`sudo ddpkit testbed slurm up`)"
    if name == "slurm_testbed" and not is_root():
        return "needs root (the Slurm testbed uses network namespaces)"
    return None


def record_outcome(name: str, status: str, reason: str, output: str = "") -> None:
    r = Result(name, name.replace("_", " "), argv=[f"{name}.py"])
    r.doc["status"], r.doc["reason"] = status, reason
    if output.strip():
        r.text("Output (last lines):\n\n```\n" + "\n".join(output.strip().splitlines()[-25:]) + "\n```")
    r.save()


def gpu_outcome() -> None:
    """gpu.sh runs only where there is a GPU; elsewhere the report says so (a GPU machine's
    figures, once copied back, are kept)."""
    if shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0:
        return  # gpu.sh writes its own results when run (bench/gpu.sh)
    for name in ("gpu_path", "gpu"):
        path = results_dir() / f"{name}.json"
        if path.exists() and json.loads(path.read_text()).get("status") == "ok":
            continue
        record_outcome(name, "not run", "no NVIDIA GPU on this machine: `bench/gpu.sh` is prepared and "
                       "dry-checked on CPU by the test suite (`bench/gpu.sh --cpu-check`: bash -n, shellcheck, "
                       "its Python parts shrunk), but no GPU figures were measured")


def stream(argv: list[str], env: dict, timeout: float) -> tuple[str, int | None]:
    """Run `argv`, printing its output as it comes; (output, exit code or None on a timeout).
    On a timeout the script's whole process group is stopped."""
    import signal
    import threading

    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "USDT:" not in line:  # kineto's profiler start/stop chatter
                lines.append(line)
                sys.stdout.write(line)
                sys.stdout.flush()

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    try:
        rc: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        rc = None
    t.join(timeout=10)
    return "".join(lines), rc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", metavar="NAME", choices=[e[0] for e in SCRIPTS] + ["gpu"])
    p.add_argument("--skip", nargs="+", metavar="NAME", default=[])
    p.add_argument("--up", action="store_true", help="bring up testbeds that are down (root)")
    p.add_argument("--quick", action="store_true", help="tiny settings: check the pipeline, not the figures")
    p.add_argument("--light", action="store_true", help="fewer repeats and steps (a loaded machine)")
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every script's timeout")
    p.add_argument("--deadline", metavar="HH:MM", help="UTC: stop starting scripts then (the rest are recorded "
                   "as not run) and cut the running one's timeout to it")
    args = p.parse_args()
    start = time.time()
    deadline = None
    if args.deadline:
        import calendar

        hh, mm = (int(x) for x in args.deadline.split(":"))
        day = time.gmtime(start)
        deadline = calendar.timegm((day.tm_year, day.tm_mon, day.tm_mday, hh, mm, 0))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    brought_up: list[str] = []
    if args.up and is_root():
        from deploy.testbed import docker

        if not docker.daemon_up():
            print("bench: bringing up the Docker testbed", flush=True)
            docker.up()
            brought_up.append("docker")
    load_start = load_average()
    try:
        order = [e for n in args.only for e in SCRIPTS if e[0] == n] if args.only else SCRIPTS
        for name, script, full, light, timeout in order:  # --only NAME...: in that order
            timeout = int(timeout * args.timeout_scale)
            if deadline is not None:
                left = deadline - time.time()
                if left < 60:
                    reason = f"not run: the run's deadline ({args.deadline} UTC) came first"
                    print(f"\n=== {name}: {reason}", flush=True)
                    record_outcome(name, "skipped", reason)
                    continue
                timeout = int(min(timeout, left))
            if name in args.skip:
                continue
            reason = skip_reason(name)
            if reason:
                print(f"\n=== {name}: skipped ({reason})", flush=True)
                record_outcome(name, "skipped", reason)
                continue
            argv = [sys.executable, str(HERE / script),
                    *(QUICK.get(name, light) if args.quick else light if args.light else full)]
            print(f"\n=== {name}: {' '.join(argv[1:])}", flush=True)
            before = (results_dir() / f"{name}.json").stat().st_mtime if (results_dir() / f"{name}.json").exists() else 0
            t = time.time()
            out, rc = stream(argv, env, timeout)
            wrote = (results_dir() / f"{name}.json").exists() and (results_dir() / f"{name}.json").stat().st_mtime > before
            if rc is None:
                record_outcome(name, "failed", f"timed out after {timeout} s", out)
            elif rc != 0:
                record_outcome(name, "failed", f"exit code {rc}", out)
            elif not wrote:  # a script that prints but writes no result file: keep what it printed
                record_outcome(name, "ok", None, out)
            print(f"=== {name}: {time.time() - t:.0f} s", flush=True)
        if not args.only or "gpu" in args.only:
            gpu_outcome()
    finally:
        for tb in brought_up:
            from deploy.testbed import docker

            print(f"bench: taking down the {tb} testbed it brought up", flush=True)
            docker.down()
    preface = results_dir() / "_preface.md"
    preface.write_text(
        f"Last `make bench`{' (quick settings: figures meaningless)' if args.quick else ' (--light settings)' if args.light else ''}: "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(start))}, {time.time() - start:.0f} s in all; "
        f"load average (1/5/15 min) {load_start} at the start and {load_average()} at the end "
        f"({os.cpu_count()} cores).\n")
    return subprocess.run([sys.executable, str(HERE / "report.py"), "--results", str(results_dir()),
                           "--preface", str(preface)], cwd=REPO).returncode


if __name__ == "__main__":
    raise SystemExit(main())
