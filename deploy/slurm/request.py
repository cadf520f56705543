"""One sbatch job as data: `SbatchRequest.of(job)`, built once from a checked JobSpec.

Both ways of submitting read it and neither restates it: the sbatch script (render.py lays it
out in slurm/job.sh.j2) and `--via submitit` (submitit.py maps it onto submitit's
SlurmExecutor). It holds the #SBATCH options, the setup lines (modules, user setup, the venv or
conda prefix), the exports (env:, the secret_env checks), the launch contract
(`trainer.contract.LaunchEnv`, the fields known before the job runs), the job step's srun
options, the container (Apptainer's argv prefix or pyxis's options) and the launch argv.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deploy import image_forms
from deploy.kube import gpu_vendor
from deploy.slurm import directives
from deploy.slurm.directives import Directive
from deploy.slurm.template import shquote
from deploy.spec import JobSpec
from trainer.contract import LAUNCH_ARGV, LaunchEnv

if TYPE_CHECKING:
    from deploy import workdir

#: DDPKIT_JOB_FILE: the validated job, written next to the logs when the job starts.
JOB_FILE = "{job_dir}/{run_id}-{job_id}.job.yaml"

#: Activates slurm.venv (`{venv}`: the quoted prefix): a venv, or a conda prefix without its
#: own activate script. Many activate scripts read unset variables: run it without `set -u`.
VENV_ACTIVATION = (
    "venv={venv}",
    "if [[ -f $venv/bin/activate ]]; then",
    "  # shellcheck source=/dev/null",
    '  source "$venv/bin/activate"',
    "else",
    "  # a conda prefix without its own activate script",
    '  export PATH="$venv/bin:$PATH" CONDA_PREFIX="$venv"',
    "fi",
)

#: secret_env: Slurm has no Secrets, the job gets the variable from the submitting environment.
SECRET_CHECK = (
    "# secret_env {name}: never written here; export it before calling sbatch.",
    ': "${{{name}:?secret_env {name} is not set: export it before sbatch (Kubernetes Secret '
    '{secret}/{key} does not exist on Slurm)}}"',
    "export {name}",
)


@dataclass(frozen=True)
class Apptainer:
    """`apptainer exec OPTIONS --bind ... IMAGE`: the prefix of the launch argv."""

    options: tuple[str, ...]  # the GPU vendor's (--nv, --rocm), --writable-tmpfs
    bind_job_dir: bool  # an absolute log dir lies outside the working directory it binds
    binds: tuple[str, ...]  # SRC:DST[:ro]
    image: str  # in the form Apptainer reads

    def argv(self, job_dir: str) -> list[str]:
        """The prefix as an argv; `job_dir` is the resolved log directory."""
        argv = ["apptainer", "exec", *self.options]
        for bind in ((job_dir,) if self.bind_job_dir else ()) + self.binds:
            argv += ["--bind", bind]
        return [*argv, self.image]


@dataclass(frozen=True)
class Pyxis:
    """pyxis/enroot's srun options (the submit directory is mounted at the same path)."""

    image: str  # in the form enroot reads
    name: str  # --container-name, a bash word (it holds $SLURM_JOB_ID)
    mount_job_dir: bool
    mounts: tuple[str, ...]  # SRC:DST[:ro]
    remap_root: bool
    writable: bool


@dataclass(frozen=True)
class SbatchRequest:
    """Everything the sbatch script and submitit both need (module docstring)."""

    directives: tuple[Directive, ...]  # #SBATCH options, in the order the script prints them
    setup: tuple[str, ...]  # bash lines before the launch: modules, slurm.setup, venv
    exports: tuple[str, ...]  # bash lines: env:, then the secret_env checks
    launch_env: LaunchEnv  # what is known before the job runs; the rest comes from Slurm's env
    step: tuple[str, ...]  # srun options of the job step
    argv: tuple[str, ...]  # what each task runs (after the container prefix)
    apptainer: Apptainer | None
    pyxis: Pyxis | None
    log_dir: str
    job_yaml: str  # the validated job, written to JOB_FILE
    requeue: bool  # slurm.requeue: requeue after the stop signal
    workdir: workdir.Snapshot | None = None  # `workdir:`, copied beside the logs at submit

    @classmethod
    def of(cls, job: JobSpec) -> SbatchRequest:
        s = job.slurm
        setup = [f"module load {shquote(m)}" for m in s.modules] + list(s.setup)
        if s.venv and s.container == "none":
            setup += [line.format(venv=shquote(s.venv)) for line in VENV_ACTIVATION]
        exports = [f"export {key}={shquote(value)}" for key, value in job.env.items()]
        for secret in job.secret_env:
            exports += [line.format(name=secret.name, secret=secret.secret, key=secret.key)
                        for line in SECRET_CHECK]
        cpus = directives.cpus_per_task(job)
        step = [f"--ntasks-per-node={directives.tasks_per_node(job)}",
                *([f"--cpus-per-task={cpus}"] if cpus is not None else []), "--kill-on-bad-exit=1"]
        log_dir_absolute = posixpath.isabs(s.log_dir)
        snapshot = None
        if job.workdir is not None:  # deploy.workdir is imported for a job that ships a tree only
            from deploy import workdir

            snapshot = workdir.snapshot(job)
        # the job file lies beside the logs: outside the working directory the container
        # mounts when the log dir is absolute, or when the working directory is the snapshot
        bind_job_dir = log_dir_absolute or snapshot is not None
        apptainer = pyxis = None
        if s.container == "apptainer":
            apptainer = Apptainer(apptainer_options(job), bind_job_dir, container_mounts(job),
                                  image_forms.apptainer(job.image))
        elif s.container == "pyxis":
            pyxis = Pyxis(image_forms.pyxis(job.image), container_name(job), bind_job_dir,
                          container_mounts(job), s.container_remap_root, s.container_writable)
        return cls(
            directives=directives.of(job), setup=tuple(setup), exports=tuple(exports),
            launch_env=LaunchEnv(run_id=job.name, nproc_per_node=job.nproc_per_node,
                                 max_restarts=job.restarts, launcher=s.launcher,
                                 stop_grace_s=s.signal_seconds),
            step=tuple(step), argv=tuple(job.command or LAUNCH_ARGV), apptainer=apptainer,
            pyxis=pyxis, log_dir=s.log_dir, job_yaml=job.to_yaml(), requeue=s.requeue,
            workdir=snapshot)

    def job_file(self, job_dir: str, job_id: str) -> str:
        """DDPKIT_JOB_FILE of job `job_id` whose resolved log directory is `job_dir`."""
        return JOB_FILE.format(job_dir=job_dir, run_id=self.launch_env.run_id, job_id=job_id)

    @property
    def workdir_dir(self) -> str | None:
        """The snapshot's directory, in the log directory: every start of the job runs there."""
        return None if self.workdir is None else self.workdir.dir_name(self.launch_env.run_id)


def gpu_vendor_flag(job: JobSpec) -> str | None:
    """Apptainer's GPU option by the vendor of gpu_resource (deploy/kube/__init__.py `gpu_vendor`):
    `--nv` for every NVIDIA name (`nvidia.com/gpu`, MIG `nvidia.com/mig-3g.40gb`,
    `nvidia.com/gpu.shared`), `--rocm` for AMD's; without it Apptainer binds neither the driver
    libraries nor the devices and the job trains on CPU (Apptainer docs, "GPU Support")."""
    if not job.gpus_per_node:
        return None
    return {"nvidia": "--nv", "amd": "--rocm"}.get(gpu_vendor(job.gpu_resource) or "")


def apptainer_options(job: JobSpec) -> tuple[str, ...]:
    """`apptainer exec` options besides the binds: the GPU vendor's, a writable tmpfs."""
    flag = gpu_vendor_flag(job)
    return ((flag,) if flag else ()) + (("--writable-tmpfs",) if job.slurm.container_writable else ())


def container_name(job: JobSpec) -> str:
    """pyxis `--container-name`, as a bash word: one per job submission (`$SLURM_JOB_ID`).

    pyxis keeps a named container on every node and, when one of that name exists, reuses its
    root filesystem and skips the import (NVIDIA/pyxis README `--container-name`;
    pyxis_slurmstepd.c: `reuse_rootfs`, with the default `container_scope=global` the name is
    `pyxis_NAME` on the node). A name shared by submissions of the same tag would run the rootfs
    of an older push; with the job id a requeue of the job (same id) still reuses its import,
    and a new submission imports the image again. The script removes the container when the
    job ends without being requeued by it (slurm/job.sh.j2)."""
    return f'ddpkit-{job.name}-"$SLURM_JOB_ID"'


def container_mounts(job: JobSpec) -> tuple[str, ...]:
    """Container bind mounts `SRC:DST[:ro]`: slurm.container_mounts plus host_path volumes."""
    mounts = list(job.slurm.container_mounts)
    for volume in job.volumes:
        if volume.host_path is not None:
            mounts.append(f"{volume.host_path}:{volume.mount}" + (":ro" if volume.read_only else ""))
    return tuple(mounts)
