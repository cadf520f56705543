"""Whole-process wall and CPU time of `ddpkit render` against TorchX's dry run, side by side.

Times, interleaved in one run so machine noise hits both alike:
  - `ddpkit render slurm examples/multinode-gpu.yaml`
  - `ddpkit render k8s   examples/multinode-gpu.yaml`
  - `torchx run --dryrun -s slurm dist.ddp -j 2x8 --script train.py` (torchx 0.7.0, installed by
    this script into a throwaway virtualenv under the system temp directory)
and prints the medians and ratios. Goal: ddpkit at most 0.8x TorchX's time. CPU time (user +
system of the process, from getrusage) is printed too: on a loaded machine it is the steadier
figure, since waiting for a core does not count.

Also timed, as the floor any pydantic job model starts from: `python -c` importing argparse,
pyyaml and pydantic and defining one one-field model (what ddpkit imports before its own code
runs; pydantic's first model loads its plugin machinery, importlib.metadata included).

ddpkit is timed as installed: its modules are byte-compiled first (`compileall`, as
`pip install` does; torchx's virtualenv got its .pyc files from pip). Without that, a tree whose
__pycache__ is missing or stale under PYTHONDONTWRITEBYTECODE=1 recompiles every module it
imports on every run (about 0.05 s for a fresh clone).

With --instructions (needs valgrind) it also counts the instructions of one run of each command
and of a ladder of partial programs (the floor, then ddpkit's modules one step at a time): the
figures do not move with the machine's load, and the steps say where the time goes. The partial
programs are plain `python -c`, without what the CLI entry (deploy/__main__.py) does around its
imports (the garbage collector paused, pydantic's plugins off): their steps add up to more than
`ddpkit render k8s` runs.

Usage: python bench/render_speed.py [--repeats N] [--torchx-venv DIR] [--instructions]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from bench_common import Result, Stats  # noqa: E402

JOB = REPO / "examples" / "multinode-gpu.yaml"
TORCHX_VERSION = "0.7.0"
FLOOR = "floor: pydantic+yaml"
FLOOR_CODE = "import argparse, yaml, pydantic\nclass M(pydantic.BaseModel):\n    x: int\n"
GOAL = 0.8  # ddpkit's time at most this times TorchX's


def ensure_torchx(venv: Path) -> Path:
    exe = venv / "bin" / "torchx"
    if not exe.exists():
        print(f"creating a throwaway venv with torchx=={TORCHX_VERSION} in {venv} ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                        "--disable-pip-version-check", f"torchx=={TORCHX_VERSION}"], check=True)
    return exe


def cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wall(argv: list[str], cwd: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of `argv`."""
    cpu0, start = cpu_of_children(), time.perf_counter()
    result = subprocess.run(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed, cpu = time.perf_counter() - start, cpu_of_children() - cpu0
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stderr}")
    return elapsed, cpu


def instructions(argv: list[str], cwd: Path) -> int:
    """Instructions executed by one run of `argv` (valgrind's cachegrind, no cache simulation)."""
    # its own output file (not /dev/null: a tool that replaces its output file would replace the device)
    with tempfile.TemporaryDirectory(prefix="ddpkit-cachegrind-") as tmp:
        result = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no",
                                 f"--cachegrind-out-file={tmp}/out", *argv],
                                cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    match = re.search(r"I\s+refs:\s+([\d,]+)", result.stderr)
    if result.returncode != 0 or not match:
        raise SystemExit(f"valgrind {' '.join(argv)} failed ({result.returncode}):\n{result.stderr}")
    return int(match.group(1).replace(",", ""))


def ladder() -> list[tuple[str, str]]:
    """Partial programs, each the one before plus one more step of `ddpkit render k8s`."""
    steps = [
        ("Python itself", "pass\n"),
        ("+ argparse, pyyaml, pydantic and one model (the floor)", FLOOR_CODE),
        ("+ ddpkit's helper modules", "import deploy.errors, deploy.kube, deploy.image_forms, "
                                      "deploy.units, deploy.yamlfile, deploy.problems\n"),
        ("+ trainer.config (2 models; the trainer's third is deferred)", "import trainer.config\n"),
        ("+ deploy.spec (13 models)", "import deploy.spec\n"),
        ("+ the argument parser (render's)", "import deploy.cli\ndeploy.cli.build_parser('render')\n"),
        ("+ reading and validating the job", f"import deploy.load\njob = deploy.load.load_job({str(JOB)!r}, [])\n"),
        ("+ the Kubernetes objects", "import deploy.k8s.render\nobjects = deploy.k8s.render.request(job)\n"),
        ("+ as YAML", "deploy.k8s.render.render_request(job, objects, source='job.yaml')\n"),
        ("+ lint's refusals of them (render refuses those)", "import deploy.lint.command\n"
                                                             "deploy.lint.command.refusals(objects)\n"),
    ]
    programs, code = [], ""
    for label, step in steps:
        code = step if label == "Python itself" else code.replace("pass\n", "") + step
        programs.append((label, code))
    return programs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--torchx-venv", type=Path,
                        default=Path(tempfile.gettempdir()) / f"ddpkit-bench-torchx-{TORCHX_VERSION}")
    parser.add_argument("--instructions", action="store_true",
                        help="also count instructions with valgrind (one run each; about a minute)")
    args = parser.parse_args()
    r = Result("render_speed", "Render time vs TorchX's dry run")
    try:
        torchx = ensure_torchx(args.torchx_venv)
    except subprocess.CalledProcessError as e:
        r.skip(f"could not install torchx=={TORCHX_VERSION} into {args.torchx_venv}: {e}")
        r.save()
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="ddpkit-bench-"))
    (workdir / "train.py").write_text("print('hello')\n")
    env_py = [sys.executable, "-m", "deploy"]
    os.environ["PYTHONPATH"] = str(REPO)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "deploy"), str(REPO / "trainer")],
                   check=True, stdout=subprocess.DEVNULL)
    commands = {
        "ddpkit render slurm": env_py + ["render", "slurm", str(JOB)],
        "ddpkit render k8s": env_py + ["render", "k8s", str(JOB)],
        FLOOR: [sys.executable, "-c", FLOOR_CODE],
        "torchx --dryrun slurm": [str(torchx), "run", "--dryrun", "-s", "slurm", "dist.ddp",
                                  "-j", "2x8", "--script", "train.py"],
    }
    for argv in commands.values():  # warm the page cache once
        wall(argv, workdir)
    times: dict[str, list[float]] = {name: [] for name in commands}
    cpus: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.repeats):
        for name, argv in commands.items():
            elapsed, cpu = wall(argv, workdir)
            times[name].append(elapsed)
            cpus[name].append(cpu)

    base = statistics.median(times["torchx --dryrun slurm"])
    cpu_base = statistics.median(cpus["torchx --dryrun slurm"])
    print(f"whole-process time, median of {args.repeats} interleaved runs ({os.cpu_count()} cores, "
          f"load {' '.join(f'{x:.1f}' for x in os.getloadavg())})")
    print(f"{'command':<24}{'wall s':>9}{'min s':>9}{'vs torchx':>11}{'CPU s':>9}{'vs torchx':>11}")
    for name, samples in times.items():
        med, cpu = statistics.median(samples), statistics.median(cpus[name])
        print(f"{name:<24}{med:>9.3f}{min(samples):>9.3f}{med / base:>10.2f}x{cpu:>9.3f}{cpu / cpu_base:>10.2f}x")
    worst = max(statistics.median(times[n]) for n in commands if n.startswith("ddpkit")) / base
    worst_cpu = max(statistics.median(cpus[n]) for n in commands if n.startswith("ddpkit")) / cpu_base
    print(f"goal: ddpkit <= {GOAL:.2f}x torchx; worst ddpkit ratio {worst:.2f}x wall, {worst_cpu:.2f}x CPU: "
          f"{'met' if worst <= GOAL else 'NOT met'}")
    floor, floor_cpu = statistics.median(times[FLOOR]) / base, statistics.median(cpus[FLOOR]) / cpu_base
    print(f"floor (argparse + pyyaml + pydantic with one model, no ddpkit code): {floor:.2f}x wall, "
          f"{floor_cpu:.2f}x CPU")
    r.text(f"Whole-process wall time on `examples/multinode-gpu.yaml`, {args.repeats} interleaved runs "
           f"after one warm-up each, against `torchx run --dryrun -s slurm dist.ddp -j 2x8` "
           f"(torchx {TORCHX_VERSION} in its own virtualenv). Goal: ddpkit <= {GOAL:.2f}x TorchX.")
    r.table("wall time per command, median (min-max, n); ratio = command / torchx", ["command", "seconds", "vs torchx"],
            [[f"`{name}`", Stats(v).fmt(".3f"), f"{statistics.median(v) / base:.2f}"] for name, v in times.items()])
    r.chart("render_speed.png", "whole-process wall time (median, min-max)", "seconds", list(times),
            {"wall time": [statistics.median(v) for v in times.values()]},
            low={"wall time": [min(v) for v in times.values()]}, high={"wall time": [max(v) for v in times.values()]})
    r.table("CPU time (user + system) per command, median (min-max, n)", ["command", "CPU seconds", "vs torchx"],
            [[f"`{name}`", Stats(v).fmt(".3f"), f"{statistics.median(v) / cpu_base:.2f}"] for name, v in cpus.items()])
    r.note(f"worst ddpkit ratio {worst:.2f}x torchx wall, {worst_cpu:.2f}x CPU: goal "
           f"{'met' if worst <= GOAL else 'NOT met'}; the floor (`{FLOOR}`: `python -c` importing "
           f"argparse, pyyaml and pydantic and defining one one-field model, no ddpkit code) is "
           f"{floor:.2f}x wall, {floor_cpu:.2f}x CPU")
    r.doc["data"] = {"wall_s": times, "cpu_s": cpus}
    if args.instructions and not shutil.which("valgrind"):
        print("--instructions: valgrind is not installed; skipped")
    elif args.instructions:
        counts = {name: instructions(argv, workdir) for name, argv in commands.items()}
        base_ir = counts["torchx --dryrun slurm"]
        steps, before = [], 0
        for label, code in ladder():
            count = instructions([sys.executable, "-c", code], workdir)
            steps.append((label, count, count - before))
            before = count
        print("\ninstructions, one run each (millions; ratio = / torchx's)")
        for name, count in counts.items():
            print(f"{name:<56}{count / 1e6:>9.1f}{count / base_ir:>8.2f}x")
        print("where `render k8s` spends them (each program = the one above plus one step; plain "
              "`python -c`, without the CLI entry's GC pause and plugin switch):")
        for label, count, step in steps:
            print(f"{label:<56}{count / 1e6:>9.1f}{count / base_ir:>8.2f}x  (+{step / 1e6:.1f})")
        r.table("instructions of one run (millions, valgrind); ratio = / torchx's",
                ["command", "M instructions", "vs torchx"],
                [[f"`{name}`", f"{c / 1e6:.1f}", f"{c / base_ir:.2f}"] for name, c in counts.items()])
        r.table("where `render k8s` spends them: each program is the one above plus one step (plain "
                "`python -c`, without the CLI entry's GC pause and plugin switch: the steps add up to more "
                "than the command)",
                ["program", "M instructions", "step", "vs torchx"],
                [[label, f"{c / 1e6:.1f}", f"+{d / 1e6:.1f}", f"{c / base_ir:.2f}"] for label, c, d in steps])
        r.doc["data"]["instructions"] = {"commands": counts, "ladder": {label: c for label, c, _ in steps}}
    r.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
