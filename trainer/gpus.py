"""Does this node show the GPUs the job asked for? Asked before any worker starts.

A job with `gpus_per_node >= 1` whose workers see no GPU must not train on CPU with exit 0
(32 GPUs idle, loss curves fine). The launcher asks here before torchrun starts (every target,
the built-in trainer and a `script:` alike), and the worker asks torch again when it picks its
device (`trainer.dist.pick_device`). Standard library only, and no CUDA call: the launcher's
process, and the warm-restart template that forks workers, must not initialize CUDA (a forked
child cannot use it). What is looked at:

- torch's CUDA build: `torch/version.py` of the installed torch, read as text (no import);
- the NVIDIA driver: NVML (`libnvidia-ml.so.1`, which the container runtime or enroot injects
  with the driver): its CUDA version, and how many GPUs it shows;
- `CUDA_VISIBLE_DEVICES` (the scheduler's choice) and `NVIDIA_VISIBLE_DEVICES` (the container
  runtime's: unset, `void` or `none` means it injected no GPU and no driver).

A CPU job (`gpus_per_node: 0`) is given `CUDA_VISIBLE_DEVICES=""` by the launcher
(`hide_from_cpu_job`), so neither the trainer nor a script trains on GPUs that the scheduler
gave to another job on the same node.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

#: NCCL's flight recorder (torch's ProcessGroupNCCL): the last collectives of every rank, dumped
#: on a collective timeout. The watchdog's phases are host times and CUDA runs ahead of the host
#: (a rank whose GPU hangs is seen blocked at its next sync, in another phase, and its healthy
#: peers look stuck too); the dump names the collective and the rank that never joined it.
FLIGHT_RECORDER_ENTRIES = "2000"

NVML_LIBRARY = "libnvidia-ml.so.1"


@dataclass(frozen=True)
class GpuFacts:
    """What this node shows a process, read without initializing CUDA."""

    torch_cuda: str | None  # torch.version.cuda of the installed torch; None: a CPU build
    torch_rocm: bool  # torch is a ROCm build (NVML does not apply)
    driver_cuda: str | None  # the highest CUDA version the driver supports (NVML); None: no driver
    nvml_gpus: int | None  # GPUs NVML shows this container; None: no driver library
    cuda_visible_devices: str | None
    nvidia_visible_devices: str | None

    @property
    def visible(self) -> int | None:
        """GPUs a CUDA process would enumerate here (CUDA_VISIBLE_DEVICES applied); None when it
        cannot be told without CUDA (UUID or MIG names, no driver library)."""
        if self.nvml_gpus is None:
            return None
        return visible_count(self.cuda_visible_devices, self.nvml_gpus)

    def describe(self) -> str:
        """The facts in words, for the one-line refusal."""
        torch_build = (f"torch built for CUDA {self.torch_cuda}" if self.torch_cuda
                       else "a ROCm build of torch" if self.torch_rocm else "a CPU-only build of torch")
        driver = (f"NVIDIA driver for CUDA {self.driver_cuda} showing {self.nvml_gpus} GPU(s)"
                  if self.nvml_gpus is not None else f"no NVIDIA driver ({NVML_LIBRARY} not found)")
        return (f"{torch_build}, {driver}, CUDA_VISIBLE_DEVICES={_shown(self.cuda_visible_devices)}, "
                f"NVIDIA_VISIBLE_DEVICES={_shown(self.nvidia_visible_devices)}")


def _shown(value: str | None) -> str:
    return "unset" if value is None else repr(value) if value == "" else value


def visible_count(cuda_visible_devices: str | None, physical: int) -> int | None:
    """How many of `physical` GPUs CUDA enumerates under CUDA_VISIBLE_DEVICES, by CUDA's rule:
    the list is read up to its first invalid entry (torch's `_parse_visible_devices` does the
    same). None for UUIDs and MIG names, which need the driver to resolve."""
    if cuda_visible_devices is None:
        return physical
    seen: list[int] = []
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip()
        if entry.startswith(("GPU-", "MIG-")):
            return None
        if not re.fullmatch(r"\d+", entry) or int(entry) >= physical:
            break
        if int(entry) in seen:  # a duplicate makes the whole list invalid
            return 0
        seen.append(int(entry))
    return len(seen)


def torch_build() -> tuple[str | None, bool]:
    """(torch.version.cuda, is a ROCm build) of the installed torch, from its version.py as text:
    importing torch costs seconds and the launcher of a GPU job must not."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None, False
    path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        text = path.read_text()
    except OSError:
        return None, False
    cuda = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
    hip = re.search(r"^hip\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return (cuda.group(1) if cuda else None), hip is not None


def nvml_facts(library: str = NVML_LIBRARY) -> tuple[str | None, int | None]:
    """(driver's CUDA version "13.0", GPU count) from NVML; (None, None) without the library
    or when NVML cannot start (no device nodes in the container)."""
    try:
        nvml = ctypes.CDLL(library)
    except OSError:
        return None, None
    if nvml.nvmlInit_v2() != 0:
        return None, None
    try:
        count, version = ctypes.c_uint(0), ctypes.c_int(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None, None
        cuda = None
        if nvml.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(version)) == 0:
            cuda = f"{version.value // 1000}.{version.value % 1000 // 10}"
        return cuda, count.value
    finally:
        nvml.nvmlShutdown()


def gather(env: Mapping[str, str] | None = None) -> GpuFacts:
    """This node's facts (the environment: this process's)."""
    env = os.environ if env is None else env
    torch_cuda, rocm = torch_build()
    driver_cuda, gpus = (None, None) if rocm else nvml_facts()
    return GpuFacts(torch_cuda, rocm, driver_cuda, gpus, env.get("CUDA_VISIBLE_DEVICES"),
                    env.get("NVIDIA_VISIBLE_DEVICES"))


def _major_minor(version: str) -> tuple[int, int]:
    major, _, minor = version.partition(".")
    return int(major), int(minor.split(".")[0] or 0)


def missing_gpus(wanted: int, facts: GpuFacts) -> str | None:
    """One line when a node of a job that asked for `wanted` GPUs per node cannot give its
    workers that many (what was looked at, and the fix); None when it can or cannot be told
    here (ROCm, UUID/MIG names: the worker's own check decides)."""
    if wanted < 1 or facts.torch_rocm:
        return None
    head = f"gpus_per_node is {wanted} but "
    if facts.torch_cuda is None:
        return (head + f"this image has {facts.describe()}: the workers would train on CPU; "
                "install torch's CUDA build in the image (ddpkit's default image has it)")
    if facts.nvml_gpus is None:
        return (head + f"no GPU reaches this container ({facts.describe()}): run it with the "
                "NVIDIA container runtime (Kubernetes: the NVIDIA device plugin's runtime; "
                "enroot/pyxis: an image with NVIDIA_VISIBLE_DEVICES=all and "
                "NVIDIA_DRIVER_CAPABILITIES=compute,utility)")
    if facts.driver_cuda and _major_minor(facts.driver_cuda)[0] < _major_minor(facts.torch_cuda)[0]:
        return (head + f"the driver is too old for this torch ({facts.describe()}): torch's CUDA "
                f"{facts.torch_cuda} needs a driver for CUDA {_major_minor(facts.torch_cuda)[0]}.x; "
                "update the nodes' driver or use an image whose torch is built for an older CUDA")
    visible = facts.visible
    if visible is not None and visible < wanted:
        return (head + f"only {visible} GPU(s) are visible here ({facts.describe()}): one rank "
                "per GPU; ask the scheduler for the GPUs (Slurm: --gpus-per-node; Kubernetes: "
                "the GPU resource) or set gpus_per_node to what the nodes have")
    return None


def hide_from_cpu_job(worker_env: dict[str, str]) -> None:
    """A CPU job's workers see no GPU: the trainer on `device: auto` and a script that asks
    `torch.cuda.is_available()` would otherwise take GPUs of the node that the scheduler gave
    to other jobs (a pod without a GPU request still sees every GPU where the image sets
    NVIDIA_VISIBLE_DEVICES=all and the NVIDIA runtime is the node's default)."""
    worker_env["CUDA_VISIBLE_DEVICES"] = ""


def flight_recorder(worker_env: dict[str, str], run_dir: Path | None) -> None:
    """A GPU job's workers keep NCCL's flight recorder and dump it on a collective timeout, into
    RUN_DIR/debug/nccl_trace_rank_<R> (the names torch's `torchfrtrace` reads) where the job has
    a run directory; a job's own settings (`env:`) win."""
    worker_env.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)
    worker_env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if run_dir is not None and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in worker_env:
        debug = Path(run_dir).resolve() / "debug"
        debug.mkdir(parents=True, exist_ok=True)
        worker_env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(debug / "nccl_trace_rank_")
