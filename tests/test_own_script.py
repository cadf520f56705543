"""Your own torchrun script (`script:` / `module:` + `args:`) through ddpkit's launcher.

The job file every target already delivers (`DDPKIT_JOB_FILE`) tells `trainer.launch` what to
run; the renderers are unchanged. Real runs start `examples/own_script/train.py`, a textbook
DDP script that knows nothing of ddpkit, and compare the parameter checksums of all ranks.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.errors import UserError
from deploy.load import parse_job
from tests.conftest import REPO, ddpkit
from tests.trainer_util import free_port, launch_env
from trainer.launch.plan import plan_launch

SCRIPT = REPO / "examples" / "own_script" / "train.py"
EXAMPLE = REPO / "examples" / "own-script.yaml"
BASE = {"name": "own", "image": "img:1"}


def checksums(text: str) -> dict[int, str]:
    """`rank R/W on HOST: params sha256 X` lines of the example script's output."""
    return {int(m[1]): m[2] for m in re.finditer(r"rank (\d+)/\d+ on \S+: params sha256 ([0-9a-f]{64})", text)}


# -- the job file ---------------------------------------------------------------------------


def test_script_args_are_strings_and_reach_the_job_yaml():
    job = parse_job({**BASE, "script": "train.py", "args": ["--epochs", 3, "--lr", 0.5]})
    assert job.args == ["--epochs", "3", "--lr", "0.5"]
    doc = yaml.safe_load(job.to_yaml())
    assert (doc["script"], doc["module"], doc["args"]) == ("train.py", None, ["--epochs", "3", "--lr", "0.5"])


@pytest.mark.parametrize("extra, message", [
    ({"script": "a.py", "module": "m"}, "module: script and module are both set; give one of them"),
    ({"args": ["--x"]}, "args: are the arguments of script or module; set one of them"),
    ({"script": "a.py", "command": ["python", "a.py"]}, "command: replaces the launcher"),
    ({"module": "9lives"}, "module: '9lives' is not a Python module name"),
    ({"script": "--help"}, "script: '--help' is not a script path"),
    ({"script": "a.py", "args": [True]}, "args.0: ambiguous YAML value"),
    ({"script": "a.py", "train": {"lr": 0.1}}, "train.lr: a setting of the built-in trainer; your script reads its own"),
    ({"module": "m", "checkpoint": {"every_steps": 5}}, "checkpoint.every_steps: a setting of the built-in trainer"),
])
def test_bad_script_settings_are_one_line_each(extra, message):
    with pytest.raises(UserError) as err:
        parse_job({**BASE, **extra})
    assert any(message in p for p in err.value.problems), err.value.problems


def test_the_launchers_own_train_settings_are_allowed_with_a_script():
    job = parse_job({**BASE, "script": "a.py", "train": {"timeout_s": 30, "threads": 2}})
    assert job.train.timeout_s == 30


# -- the launcher: the same plan, another program ------------------------------------------


@pytest.mark.parametrize("entry, tail", [
    (None, ["-m", "trainer.train"]),
    (["train.py", "--epochs", "3"], ["train.py", "--epochs", "3"]),
    (["-m", "pkg.train", "--x"], ["-m", "pkg.train", "--x"]),
])
def test_every_mode_runs_the_entry(entry, tail):
    torchrun = plan_launch({"DDPKIT_NPROC_PER_NODE": "2", "DDPKIT_MASTER_PORT": "4000"}, python="/py", entry=entry)
    assert torchrun.argv[:3] == ["/py", "-m", "torch.distributed.run"]
    assert torchrun.argv[-len(tail):] == tail and "--signals-to-handle" in torchrun.argv
    srun = plan_launch({"SLURM_JOB_ID": "7", "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
                        "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "n1",
                        "DDPKIT_LAUNCHER": "srun"}, python="/py", entry=entry)
    assert srun.argv == ["/py", *tail] and srun.env["RANK"] == "0"
    direct = plan_launch({"TORCHELASTIC_RUN_ID": "x"}, python="/py", entry=entry)
    assert direct.argv == ["/py", *tail]


def test_a_missing_script_stops_the_launcher_with_one_line(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "own", "script": "nope/train.py"}))
    result = subprocess.run([sys.executable, "-m", "trainer.launch"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60, env=launch_env(job))
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"ddpkit launch: script nope/train.py: no such file in {tmp_path}")


# -- ddpkit init ------------------------------------------------------------------------------


@pytest.mark.parametrize("option, value, line", [
    ("--script", "my train.py", 'script: "my train.py"'),
    ("--module", "mypkg.train", 'module: "mypkg.train"'),
])
def test_init_offers_your_own_script(tmp_path, option, value, line):
    result = ddpkit("init", "job.yaml", option, value, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "job.yaml").read_text()
    assert line in text and "\ntrain:" not in text and "\ncheckpoint:" not in text
    check = ddpkit("validate", str(tmp_path / "job.yaml"))
    assert check.returncode == 0, check.stderr
    assert "runs " + ("my train.py" if option == "--script" else "-m mypkg.train") in check.stdout


# -- real runs --------------------------------------------------------------------------------


@pytest.mark.slow
def test_ddpkit_run_local_runs_the_textbook_script_unchanged(tmp_path):
    result = ddpkit("run", str(EXAMPLE), "--local", "--set", f"script={SCRIPT}",
                    "--set", "args=[--epochs, '1', --samples, '512', --out, out]", cwd=tmp_path,
                    env={"OMP_NUM_THREADS": "1"}, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"{SCRIPT} --epochs 1 --samples 512 --out out" in result.stderr  # torchrun ran it
    sums = checksums(result.stdout)
    assert sorted(sums) == [0, 1] and len(set(sums.values())) == 1, result.stdout
    files = {p.name: p.read_text().strip() for p in (tmp_path / "out").glob("params-rank*.sha256")}
    assert sorted(files) == ["params-rank0.sha256", "params-rank1.sha256"]
    assert set(files.values()) == set(sums.values())


OLD_LAUNCH_SCRIPT = """
import argparse, os
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)  # as torch.distributed.launch gave it
parser.add_argument("--out")
args = parser.parse_args()
dist.init_process_group("gloo")
with open(os.path.join(args.out, f"rank{dist.get_rank()}"), "w") as fh:
    fh.write(f"{args.local_rank} {os.environ.get('ACCELERATE_USE_CPU')}")
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_script_that_reads_local_rank_from_its_arguments_gets_it_per_rank(tmp_path):
    """`local_rank_arg: --local_rank`: each rank gets its own `--local_rank=N` (torchrun gives
    none); a CPU job tells Accelerate to use the CPU (ACCELERATE_USE_CPU=1)."""
    (tmp_path / "old.py").write_text(OLD_LAUNCH_SCRIPT)
    (tmp_path / "out").mkdir()
    job = tmp_path / "old.yaml"
    job.write_text(yaml.safe_dump({**BASE, "name": "old", "procs_per_node": 2, "script": "old.py",
                                   "local_rank_arg": "--local_rank", "args": ["--out", "out"]}))
    result = ddpkit("run", str(job), "--local", cwd=tmp_path, env={"OMP_NUM_THREADS": "1"}, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {p.name: p.read_text() for p in (tmp_path / "out").iterdir()} == {"rank0": "0 1", "rank1": "1 1"}


@pytest.mark.slow
def test_ddpkit_run_local_runs_a_two_node_job_as_two_node_launchers(tmp_path):
    """`nodes: 2` locally is two node launchers (node ranks 0 and 1, as two pods of an Indexed
    Job), the world size the cluster would have: 2 x 2 ranks, one set of parameters."""
    result = ddpkit("run", str(EXAMPLE), "--local", "--set", f"script={SCRIPT}", "--set", "nodes=2",
                    "--set", "args=[--epochs, '1', --samples, '512', --out, out]", cwd=tmp_path,
                    env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "as 2 local nodes x 2 processes" in result.stderr
    assert "context indexed-job, node rank 1" in result.stdout + result.stderr
    sums = checksums(result.stdout)
    assert sorted(sums) == [0, 1, 2, 3] and len(set(sums.values())) == 1, result.stdout
    assert re.search(r"rank 3/4 on ", result.stdout), result.stdout


@pytest.mark.slow
def test_a_module_runs_in_srun_mode_as_the_slurm_tasks(tmp_path):
    """One task per process (srun mode): the launcher execs `python -m MODULE ARGS` itself."""
    (tmp_path / "ownpkg").mkdir()
    (tmp_path / "ownpkg" / "__init__.py").write_text("")
    (tmp_path / "ownpkg" / "train.py").write_text(SCRIPT.read_text())
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "own", "module": "ownpkg.train",
                                   "args": ["--epochs", "1", "--samples", "256", "--out", "out"]}))
    port = str(free_port())
    procs = [subprocess.Popen(
        [sys.executable, "-m", "trainer.launch"], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env=launch_env(job, SLURM_JOB_ID="77", SLURM_NODEID="0", SLURM_PROCID=str(r), SLURM_NTASKS="2",
                       SLURM_LOCALID=str(r), SLURM_NTASKS_PER_NODE="2", SLURM_JOB_NODELIST="localhost",
                       DDPKIT_LAUNCHER="srun", DDPKIT_MASTER_ADDR="127.0.0.1", DDPKIT_MASTER_PORT=port,
                       PYTHONPATH=f"{REPO}:{tmp_path}"))
        for r in (0, 1)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "mode srun: -m trainer.guard -m ownpkg.train --epochs 1" in outs[0]  # under the guard (stacks)
    sums = checksums("".join(outs))
    assert sorted(sums) == [0, 1] and len(set(sums.values())) == 1
    assert Path(tmp_path / "out" / "params-rank1.sha256").read_text().strip() == sums[0]


# -- extra torchrun options (torchrun_args) ----------------------------------------------------


def test_torchrun_args_go_before_the_program_and_the_launchers_own_are_refused(tmp_path):
    job = parse_job({**BASE, "script": "train.py", "torchrun_args": ["--monitor-interval=1", "--local-ranks-filter=0"]})
    assert job.torchrun_args == ["--monitor-interval=1", "--local-ranks-filter=0"]
    env = {"DDPKIT_NNODES": "1", "DDPKIT_NPROC_PER_NODE": "2", "DDPKIT_MASTER_ADDR": "h",
           "DDPKIT_MASTER_PORT": "29500", "JOB_COMPLETION_INDEX": "0"}
    argv = plan_launch(env, entry=["train.py"], torchrun_args=job.torchrun_args).argv
    assert argv[-3:] == ["--monitor-interval=1", "--local-ranks-filter=0", "train.py"]
    for option, owner in (("--nnodes=2", "nodes"), ("--rdzv-endpoint=x:1", "the target"),
                          ("--max_restarts=3", "restarts")):
        with pytest.raises(UserError, match=f"torchrun_args: {option.split('=')[0]}: the launcher sets it from {owner}"):
            parse_job({**BASE, "torchrun_args": [option]})


@pytest.mark.slow
def test_ddpkit_run_local_passes_torchrun_args_to_torchrun(tmp_path):
    """torchrun's own --log-dir (an option the launcher never sets) creates its log directory."""
    result = ddpkit("run", str(EXAMPLE), "--local", "--set", f"script={SCRIPT}",
                    "--set", "args=[--epochs, '1', --samples, '256', --out, out]",
                    "--set", f"torchrun_args=[--log-dir={tmp_path / 'tlogs'}]", cwd=tmp_path,
                    env={"OMP_NUM_THREADS": "1"}, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"--log-dir={tmp_path / 'tlogs'}" in result.stderr
    assert any((tmp_path / "tlogs").rglob("*")), "torchrun wrote no logs under --log-dir"


# -- the guard's exit -------------------------------------------------------------------------


def test_the_guard_exits_a_finished_script_as_the_interpreter_would(tmp_path):
    """A finished script leaves through `os._exit` (no interpreter finalization, where a gloo
    rank once aborted after its last line), but its non-daemon threads still finish, its
    atexit handlers run, its buffered output is flushed, and its own exit code stands."""
    script = tmp_path / "finish.py"
    script.write_text(
        "import atexit, sys, threading, time\n"
        "from pathlib import Path\n"
        "atexit.register(lambda: Path('atexit.txt').write_text('ran'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.5), Path('thread.txt').write_text('done'))).start()\n"
        "sys.stdout.write('buffered, no newline')\n"
        "sys.exit(int(sys.argv[1]))\n")
    for code in (0, 3):
        for name in ("atexit.txt", "thread.txt"):
            (tmp_path / name).unlink(missing_ok=True)
        proc = subprocess.run([sys.executable, "-m", "trainer.guard", str(script), str(code)], cwd=tmp_path,
                              env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == code, proc.stderr
        assert proc.stdout == "buffered, no newline"
        assert (tmp_path / "atexit.txt").read_text() == "ran"
        assert (tmp_path / "thread.txt").read_text() == "done"
