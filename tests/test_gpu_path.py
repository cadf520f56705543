"""The GPU path on a machine without a GPU: what the node shows is faked at the torch (or NVML)
boundary where it must be, and real processes show the rest.

A job that asked for GPUs and finds none stops at once with one line (launcher, preflight and
the worker's own device choice); a CPU job never takes a node's GPUs; ranks map to GPUs by one
rule; after an exception an NCCL group is aborted, not waited on; `precision: auto` asks for
native bf16; the warm-restart template refuses to fork once the CUDA driver is loaded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from tests.trainer_util import REPO, launch_env, run, write_job
from trainer import gpus
from trainer.contract import EXIT_BAD_CONFIG

torch = pytest.importorskip("torch")


def facts(**changed) -> gpus.GpuFacts:
    """A healthy 8-GPU node of a CUDA 13 torch, with `changed` applied."""
    base = dict(torch_cuda="13.0", torch_rocm=False, driver_cuda="13.0", nvml_gpus=8,
                cuda_visible_devices=None, nvidia_visible_devices="all")
    return gpus.GpuFacts(**{**base, **changed})


# -- what the launcher decides from the node's facts -----------------------------------------

@pytest.mark.parametrize("changed, says", [
    ({"torch_cuda": None}, "a CPU-only build of torch"),
    ({"nvml_gpus": None, "driver_cuda": None, "nvidia_visible_devices": None},
     "no NVIDIA driver (libnvidia-ml.so.1 not found)"),
    ({"driver_cuda": "12.4"}, "the driver is too old for this torch"),
    ({"cuda_visible_devices": "0,1"}, "only 2 GPU(s) are visible here"),
    ({"cuda_visible_devices": ""}, "only 0 GPU(s) are visible here"),
])
def test_a_gpu_job_on_a_node_without_its_gpus_is_one_line_naming_what_was_looked_at(changed, says):
    line = gpus.missing_gpus(8, facts(**changed))
    assert line is not None and "\n" not in line
    assert line.startswith("gpus_per_node is 8 but ") and says in line
    for looked_at in ("CUDA_VISIBLE_DEVICES=", "NVIDIA_VISIBLE_DEVICES=", "torch"):
        assert looked_at in line


@pytest.mark.parametrize("changed", [
    {},  # all 8 there
    {"cuda_visible_devices": "0,1,2,3,4,5,6,7"},
    {"cuda_visible_devices": "GPU-0b1c,GPU-3f2e"},  # UUIDs: only CUDA can tell (the worker does)
    {"torch_rocm": True, "torch_cuda": None, "nvml_gpus": None},  # ROCm: not NVML's to say
])
def test_a_node_that_shows_the_gpus_or_cannot_be_judged_without_cuda_passes(changed):
    assert gpus.missing_gpus(8, facts(**changed)) is None


@pytest.mark.parametrize("cuda_visible_devices", [None, "", "0", "1,0", "0,5", "3,9,1", "0,0", "x,1", "1,x"])
def test_visible_gpus_are_counted_as_torch_counts_them(monkeypatch, cuda_visible_devices):
    """torch's own NVML-based count (CUDA's rule for CUDA_VISIBLE_DEVICES) is the oracle."""
    physical = 4
    if cuda_visible_devices is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cuda_visible_devices)
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: physical)
    assert gpus.visible_count(cuda_visible_devices, physical) == torch.cuda._device_count_nvml()


def test_the_torch_build_is_read_without_importing_torch():
    probe = ("import sys, trainer.gpus as g; build = g.torch_build(); "
             "print(build[0], build[1], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(torch.version.cuda), str(torch.version.hip is not None), "False"]


def test_no_driver_library_means_no_nvml_facts():
    assert gpus.nvml_facts("libnvidia-ml-that-is-not-here.so.1") == (None, None)


# -- real launchers on this GPU-less machine --------------------------------------------------

def gpu_job(tmp_path: Path, **top) -> Path:
    job = write_job(tmp_path, "gpujob", {"max_steps": 2})
    doc = {**yaml.safe_load(job.read_text()), "gpus_per_node": 1, **top}
    job.write_text(yaml.safe_dump(doc))
    return job


@pytest.mark.parametrize("entry", [{}, {"script": "train.py"}])
def test_the_launcher_stops_a_gpu_job_before_any_worker_starts(tmp_path, entry):
    """The built-in trainer and a script alike: exit 2, one line, no torchrun, and the refusal
    kept in the run directory for `ddpkit why`."""
    (tmp_path / "train.py").write_text("open('ran', 'w').write('yes')\n")
    job = gpu_job(tmp_path, **entry)
    result = run(job, tmp_path, nproc=1, timeout=120)
    assert result.returncode == EXIT_BAD_CONFIG, result.stdout[-2000:]
    lines = [line for line in result.stdout.splitlines() if "gpus_per_node is 1 but" in line]
    assert len(lines) == 1 and "a CPU-only build of torch" in lines[0], result.stdout[-2000:]
    assert "Traceback" not in result.stdout and "torch.distributed.run" not in result.stdout
    assert not (tmp_path / "ran").exists()
    records = list((tmp_path / "runs" / "gpujob" / "attempts" / "launch").glob("*.json"))
    assert len(records) == 1 and "gpus_per_node is 1 but" in records[0].read_text()


def test_preflight_on_a_node_stops_a_gpu_job_the_same_way(tmp_path):
    job = gpu_job(tmp_path)
    result = subprocess.run([sys.executable, "-m", "trainer.preflight"], cwd=tmp_path,
                            env=launch_env(job, nproc=1), capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_BAD_CONFIG
    assert "gpus_per_node is 1 but" in result.stderr.strip().splitlines()[-1]


def test_a_cpu_jobs_workers_see_no_gpu(tmp_path):
    """The trainer on `device: auto` and a script that asks torch alike: a pod without a GPU
    request may still see every GPU of its node (NVIDIA_VISIBLE_DEVICES=all in the image)."""
    (tmp_path / "train.py").write_text(
        "import os\nopen(f\"seen-{os.environ['RANK']}\", 'w').write(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))\n")
    job = write_job(tmp_path, "cpujob")
    job.write_text(yaml.safe_dump({**yaml.safe_load(job.read_text()), "train": {"threads": 1},
                                   "script": "train.py"}))
    result = run(job, tmp_path, nproc=2, timeout=120, CUDA_VISIBLE_DEVICES="0,1")
    assert result.returncode == 0, result.stdout[-2000:]
    assert [(tmp_path / f"seen-{r}").read_text() for r in (0, 1)] == ["''", "''"]


# -- the worker's device choice, faked at the torch boundary -----------------------------------

def fake_cuda(monkeypatch, count: int) -> list[int]:
    """torch.cuda as on a node with `count` GPUs; returns the devices `set_device` was given."""
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_a_gpu_worker_that_sees_no_gpu_stops_instead_of_training_on_cpu(monkeypatch):
    from trainer.dist import DistEnv, DistEnvError, pick_device

    fake_cuda(monkeypatch, 0)
    with pytest.raises(DistEnvError, match="gpus_per_node is 8 but torch sees no GPU here"):
        pick_device(DistEnv(local_rank=3, local_world_size=8), "auto", gpus_per_node=8)


def test_a_cpu_job_trains_on_cpu_on_a_gpu_node(monkeypatch):
    from trainer.dist import DistEnv, pick_device

    chosen = fake_cuda(monkeypatch, 8)
    assert pick_device(DistEnv(local_rank=1, local_world_size=2), "auto", gpus_per_node=0).type == "cpu"
    assert chosen == []


def test_preflight_maps_ranks_to_gpus_by_the_trainers_rule(monkeypatch):
    """Two ranks on a node that shows one GPU: a verdict, not NCCL's "Duplicate GPU" crash
    (`local_rank % device_count()` put both on GPU 0)."""
    from trainer import preflight

    chosen = fake_cuda(monkeypatch, 1)
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    with pytest.raises(preflight.PreflightError, match="2 ranks on this node but 1 GPU"):
        preflight.device_of(env, "auto", 2)
    assert chosen == []
    fake_cuda(monkeypatch, 2)
    assert str(preflight.device_of(env, "auto", 2)) == "cuda:1"


def test_preflight_gives_the_job_its_nccl_settings_back(monkeypatch):
    from trainer import preflight

    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.delenv("NCCL_DEBUG_SUBSYS", raising=False)
    monkeypatch.delenv("NCCL_DEBUG_FILE", raising=False)
    logs, before = preflight.nccl_debug_logs()
    assert os.environ["NCCL_DEBUG_FILE"].startswith(logs) and os.environ["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    preflight.restore_env(before)
    assert os.environ["NCCL_DEBUG"] == "WARN"
    assert "NCCL_DEBUG_SUBSYS" not in os.environ and "NCCL_DEBUG_FILE" not in os.environ


def test_precision_auto_takes_fp16_where_bf16_would_only_be_emulated(monkeypatch):
    """A T4 (compute capability 7.5): torch can emulate bf16 there, slowly; `auto` means fp16."""
    from trainer.train import autocast_dtype, native_bf16

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(major=7, minor=5))
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda d: True)
    assert torch.cuda.is_bf16_supported()  # what the default (emulation included) says
    assert autocast_dtype("auto", "cuda", native_bf16()) == "float16"
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(major=9, minor=0))
    assert autocast_dtype("auto", "cuda", native_bf16()) == "bfloat16"


# -- leaving the group after an exception ----------------------------------------------------

def test_an_nccl_group_is_aborted_after_an_exception_not_waited_on(monkeypatch):
    import torch.distributed as dist

    from trainer.dist import leave_after_error

    called: list[str] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda: called.append("abort"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: called.append("destroy"))
    leave_after_error(dist)
    assert called == ["abort"]


def test_a_gloo_group_is_destroyed_after_an_exception(tmp_path):
    """A real one-rank gloo group goes through the same exit path as the trainer's."""
    code = (
        "import os, torch.distributed as dist\n"
        "from trainer.dist import DistEnv, process_group\n"
        "import torch\n"
        "denv = DistEnv(0, 1, 0, 1, '127.0.0.1', int(os.environ['MASTER_PORT']))\n"
        "try:\n"
        "    with process_group(denv, torch.device('cpu'), 30):\n"
        "        raise KeyError('boom')\n"
        "except KeyError:\n"
        "    print('initialized after:', dist.is_initialized())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO), "RANK": "0", "WORLD_SIZE": "1",
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    assert "initialized after: False" in out.stdout, out.stderr[-2000:]


def _free_port() -> int:
    from tests.trainer_util import free_port

    return free_port()


# -- the warm-restart template ---------------------------------------------------------------

def test_a_template_with_the_cuda_driver_loaded_may_not_fork(tmp_path, monkeypatch):
    from trainer import warm

    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 00:00 0 /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54\n")
    assert not warm._cuda_driver_loaded(str(maps))  # NVML alone does not initialize CUDA
    maps.write_text("7f00-7f01 r-xp 0 00:00 0 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54\n")
    assert warm._cuda_driver_loaded(str(maps))
    monkeypatch.setattr(warm, "_cuda_driver_loaded", lambda: True)
    monkeypatch.setattr(os, "listdir", lambda path: ["1"])  # one thread
    assert "CUDA driver loaded" in warm._fork_unsafe()


@pytest.mark.slow
def test_a_worker_whose_client_died_is_gone_before_its_successor_is_forked(tmp_path):
    """torchrun's restart after a kill: the successor must not find its predecessor (and the GPU
    memory it held) still there."""
    from tests.test_warm import client, env_for, sleeper

    sock = tmp_path / "t.sock"
    template = subprocess.Popen([sys.executable, "-m", "trainer.warm", "--serve", str(sock)], env=env_for(),
                                stdin=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        first, worker = sleeper(tmp_path, sock)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        probe = tmp_path / "probe.py"
        probe.write_text("import os, sys\nprint(os.path.exists(f'/proc/{sys.argv[1]}'))\n")
        second = client(sock, probe, str(worker))
        out, err = second.communicate(timeout=60)
        assert out.strip() == "False", err
    finally:
        template.stdin.close()
        template.wait(timeout=30)


# -- the rest of the GPU settings --------------------------------------------------------------

def test_a_gpu_jobs_workers_keep_ncclss_flight_recorder_in_the_run_directory(tmp_path):
    env: dict[str, str] = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}  # a job's own setting wins
    gpus.flight_recorder(env, tmp_path / "runs" / "j")
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == gpus.FLIGHT_RECORDER_ENTRIES
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str((tmp_path / "runs" / "j" / "debug" / "nccl_trace_rank_").resolve())
    assert (tmp_path / "runs" / "j" / "debug").is_dir()


def test_deterministic_mode_trains_and_says_what_it_set(tmp_path):
    job = write_job(tmp_path, "det", {"max_steps": 2, "deterministic": True})
    result = run(job, tmp_path, nproc=1, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:]
    assert "deterministic: torch.use_deterministic_algorithms(True), cudnn.benchmark off, " \
           "CUBLAS_WORKSPACE_CONFIG=:4096:8" in result.stdout
