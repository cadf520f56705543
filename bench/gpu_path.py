"""The first minutes on a GPU (run by `bench/gpu.sh`): what a first real run would hit.

Everything goes through the launcher every target starts (`python -m trainer.launch`, one node,
one GPU) and the trainer's own records (metrics.jsonl), so what is measured is the product:

1. NCCL: `python -m trainer.preflight` for a one-GPU job (its verdict line: NCCL's version and
   the network NCCL chose), and NCCL's 1-rank init (init_process_group with device_id, then the
   first all-reduce, which builds the communicator), timed in a fresh process;
2. checkpoints of the `gpt` state on the GPU: the blocking time of a synchronous vs an
   asynchronous save (the trainer's `checkpoint` events); the load is timed in 3 (the resumed
   attempt's `checkpoint_load` seconds);
3. a worker killed (SIGKILL) mid-run: torchrun restarts the group, the node's template forks
   the successor (warm restart: the template never initialized CUDA, its dead predecessor had),
   and the run resumes from the newest checkpoint; kill -> first step again, and whether the
   interrupted run ends with the same parameters as an uninterrupted one (`train.deterministic`
   on, then off), compared by the trainer's own parameter checksum.

    python bench/gpu_path.py [--cpu-check]

`--cpu-check`: the same runs with a tiny model on CPU (gloo): a dry check of this script.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from bench_common import Result, fmt  # noqa: E402
from gpu_bench import env_for, free_port  # noqa: E402

GPT = {"model": "gpt", "optimizer": "adamw", "lr": 3e-4, "batch_size": 16,
       "model_args": {"d_model": 768, "layers": 12, "heads": 12, "seq_len": 1024, "vocab": 256, "samples": 4096}}
TINY = {"model": "gpt", "optimizer": "adamw", "lr": 3e-4, "batch_size": 4, "threads": 1,
        "model_args": {"d_model": 32, "layers": 1, "heads": 2, "seq_len": 16, "vocab": 64, "samples": 512}}

INIT_PROBE = """
import os, sys, time, datetime
t0 = time.perf_counter()
import torch, torch.distributed as dist
t1 = time.perf_counter()
cuda = sys.argv[1] == "cuda"
device = torch.device("cuda", 0) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
    torch.ones(1, device=device)  # the CUDA context, timed apart from NCCL
    torch.cuda.synchronize()
t2 = time.perf_counter()
dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None,
                        timeout=datetime.timedelta(seconds=120))
t3 = time.perf_counter()
x = torch.ones(1 << 20, device=device)
dist.all_reduce(x)
if cuda:
    torch.cuda.synchronize()
t4 = time.perf_counter()
dist.destroy_process_group()
print({"import_s": t1 - t0, "context_s": t2 - t1, "init_s": t3 - t2, "first_allreduce_s": t4 - t3})
"""


def job_file(work: Path, name: str, train: dict, gpus: int, **top) -> Path:
    import yaml

    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "gpus_per_node": gpus, **top, "train": {
        "eval_every_epochs": 0, "plot": False, "log_every_steps": 5, **train}}))
    return path


def launch(job: Path, work: Path, device: str, restarts: int = 0, **extra: str) -> subprocess.Popen:
    env = {**env_for(device), "DDPKIT_JOB_FILE": str(job), "DDPKIT_NPROC_PER_NODE": "1",
           "DDPKIT_MAX_RESTARTS": str(restarts), "DDPKIT_MASTER_PORT": str(free_port()), **extra}
    return subprocess.Popen([sys.executable, "-m", "trainer.launch"], cwd=work, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, timeout: float, what: str) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise RuntimeError(f"{what}: over {timeout:.0f} s: {out[-1500:]}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{what}: exit {proc.returncode}: {out[-1500:]}")
    return out


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steps_done(run_dir: Path) -> int:
    return max([r["step"] for r in records(run_dir) if "loss" in r and "step" in r] or [0])


def worker_pid(job: Path) -> int | None:
    """The rank-0 worker of `job` (a forked worker is named `ddpkit-rank0`; a cold one runs
    `python -m trainer.train`): found by its environment's DDPKIT_JOB_FILE."""
    mine = f"DDPKIT_JOB_FILE={job}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if mine in env and b"RANK=0" in env and (comm == "ddpkit-rank0" or b"trainer.train" in cmd):
            return int(pid)
    return None


def nccl_section(r: Result, work: Path, device: str, train: dict) -> None:
    gpus = 1 if device == "cuda" else 0
    job = job_file(work, "preflight", {**train, "max_steps": 1}, gpus)
    env = {**env_for(device), "DDPKIT_JOB_FILE": str(job), "DDPKIT_NPROC_PER_NODE": "1",
           "DDPKIT_MASTER_PORT": str(free_port())}
    pf = subprocess.run([sys.executable, "-m", "trainer.preflight"], cwd=work, env=env, capture_output=True,
                        text=True, timeout=180)
    verdict = [line for line in (pf.stdout + pf.stderr).splitlines() if line.startswith("ddpkit preflight:")]
    r.text("Preflight on one GPU (`python -m trainer.preflight`), its verdict line:\n\n    "
           + (verdict[-1] if verdict else f"(no verdict, exit {pf.returncode}: {(pf.stdout + pf.stderr)[-500:]})"))
    rows = []
    for attempt in range(3):
        out = subprocess.run([sys.executable, "-c", INIT_PROBE, device], cwd=work, capture_output=True, text=True,
                             timeout=180, env={**env_for(device), "RANK": "0", "WORLD_SIZE": "1",
                                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
        if out.returncode != 0:
            r.note(f"init probe failed: {out.stderr[-500:]}")
            return
        t = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307  (our own probe's dict)
        rows.append([attempt + 1, *(fmt(t[k], ".3f") for k in ("import_s", "context_s", "init_s", "first_allreduce_s"))])
    r.table(f"{'NCCL' if device == 'cuda' else 'gloo'} 1-rank start, seconds (3 fresh processes)",
            ["run", "import torch", "CUDA context", "init_process_group", "first all-reduce (4 MiB)"], rows)


def checkpoint_section(r: Result, work: Path, device: str, train: dict, steps: int) -> None:
    gpus = 1 if device == "cuda" else 0
    rows = []
    for async_save in (False, True):
        name = f"ckpt-{'async' if async_save else 'sync'}"
        job = job_file(work, name, {**train, "max_steps": steps}, gpus,
                       checkpoint={"every_steps": max(1, steps // 4), "async_save": async_save, "keep": 2})
        finish(launch(job, work, device), 600, name)
        blocking = [e["blocking_s"] for e in records(work / "runs" / name) if e.get("event") == "checkpoint"]
        size = max(p.stat().st_size for p in (work / "runs" / name / "checkpoints").glob("ckpt-*.pt"))
        rows.append(["asynchronous" if async_save else "synchronous", len(blocking),
                     fmt(min(blocking) if blocking else None, ".3f"), fmt(max(blocking) if blocking else None, ".3f"),
                     fmt(size / 2**20, ".1f")])
    r.table("checkpoint of the gpt state: the training loop's blocking time per save, seconds",
            ["save", "saves", "blocking min", "blocking max", "file MiB"], rows)


def restart_section(r: Result, work: Path, device: str, train: dict, steps: int) -> None:
    gpus = 1 if device == "cuda" else 0
    # a tiny CPU model trains 40 steps in well under a second: checkpoints that take longer pace
    # it, so that the kill lands mid-run (the dry check only)
    pace = {"DDPKIT_FAULT_SAVE_DELAY_S": "0.3"} if device == "cpu" else {}
    rows = []
    for deterministic in (True, False):
        shas = {}
        for interrupted in (False, True):
            name = f"{'det' if deterministic else 'nondet'}-{'killed' if interrupted else 'straight'}"
            job = job_file(work, name, {**train, "max_steps": steps, "deterministic": deterministic}, gpus,
                           restarts=1, checkpoint={"every_steps": max(1, steps // 4), "keep": 2})
            proc = launch(job, work, device, restarts=1, **pace)
            run_dir = work / "runs" / name
            kill_s = first_again = None
            if interrupted:
                deadline = time.monotonic() + 400
                while steps_done(run_dir) < steps // 2 and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                pid = worker_pid(job)
                if pid is None:
                    r.note(f"{name}: no worker found to kill")
                else:
                    before = steps_done(run_dir)
                    kill_s = time.time()
                    os.kill(pid, signal.SIGKILL)
                    while proc.poll() is None and time.monotonic() < deadline:
                        again = [e for e in records(run_dir) if e.get("event") == "resumed"]
                        if again and steps_done(run_dir) > int(again[-1]["step"]):
                            first_again = time.time() - kill_s
                            break
                        time.sleep(0.02)
                    r.note(f"{name}: killed rank 0 (pid {pid}) after step {before}")
            out = finish(proc, 600, name)
            summary = next(e for e in reversed(records(run_dir)) if e.get("summary"))
            shas[interrupted] = summary.get("final_params_sha256")
            if interrupted:
                forked = "ddpkit warm: template" in out and "forking is unsafe" not in out
                second = json.loads((run_dir / "attempts" / "attempt-1.json").read_text())
                rows.append(["on" if deterministic else "off", second.get("restarts"), fmt(first_again, ".2f"),
                             fmt(second["classes"].get("checkpoint_load"), ".3f"), "yes" if forked else "no",
                             "yes" if shas[True] == shas[False] and shas[True] else "no"])
    r.table(f"a worker killed (SIGKILL) at step {steps // 2} of {steps}, restarts: 1",
            ["train.deterministic", "restarts", "kill -> training again, s", "checkpoint load, s", "warm (forked)",
             "final parameters = uninterrupted run's"], rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-check", action="store_true", help="tiny model on CPU: check the script, not the GPU")
    args = p.parse_args()
    import torch

    device = "cpu" if args.cpu_check else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_path: torch sees no CUDA device; use --cpu-check for a dry run on CPU")
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "CPU dry check"
    r = Result("gpu_path_cpu_check" if args.cpu_check else "gpu_path",
               f"GPU: the first minutes (NCCL, checkpoints, a killed worker) on {gpu}")
    train, steps = (TINY, 40) if args.cpu_check else (GPT, 80)
    r.text(f"{gpu}, torch {torch.__version__}; workload gpt {train['model_args']}, batch {train['batch_size']}, "
           "AdamW, one process through `python -m trainer.launch` (the entry point of every target).")
    with tempfile.TemporaryDirectory(prefix="ddpkit-gpu-path-") as tmp:
        for section in (nccl_section, checkpoint_section, restart_section):
            t = time.time()
            try:
                if section is nccl_section:
                    section(r, Path(tmp), device, train)
                else:
                    section(r, Path(tmp), device, train, steps)
            except (RuntimeError, OSError, subprocess.SubprocessError, StopIteration, KeyError) as e:
                r.note(f"{section.__name__}: failed: {str(e)[:800]}")
            print(f"gpu_path: {section.__name__} done in {time.time() - t:.0f} s", flush=True)
    r.save()
    return 1 if any("failed" in n for n in r.doc.get("notes", [])) else 0


if __name__ == "__main__":
    raise SystemExit(main())
