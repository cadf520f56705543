"""Does a job's checkpoint directory survive a restart? One rule per target, used by the
targets' checks (deploy/problems.py), so `validate` and `render` refuse the same jobs.

A job needs its checkpoints to survive when something restarts it (`restarts` > 0, Slurm
requeues) or when it spans several nodes (every node resumes from the checkpoint rank 0 wrote,
so it must be on storage they share and that outlives a pod or a container). Then:

- Kubernetes: the directory must be on a `claim`, `nfs` or `host_path` volume mounted at or
  above it. A relative directory is in the container's working directory, and an `empty_dir`
  belongs to one pod: both are gone when the pod is recreated, and other nodes never see them.
- Slurm without a container: a relative directory is under the submit directory (a cluster's
  shared filesystem, as for every Slurm job); an absolute one is a host path (a claim or nfs
  volume's mount must be the cluster's shared filesystem there, as the script's header says),
  unless it is the mount of a `host_path` volume elsewhere, which nothing mounts without a
  container, or a node-local directory (below).
- Slurm in pyxis or Apptainer: a relative directory is under the submit directory, which is
  mounted; an absolute one must be under a container mount (`slurm.container_mounts` or a
  `host_path` volume), else it is inside the container and lost when the job ends.

On every target the host directory that finally holds the checkpoints (the path itself on bare
Slurm, a container mount's source, a `host_path` volume's host path on Kubernetes) must not be
node-local (`NODE_LOCAL`): `/dev/shm`, `/tmp`, `/var/tmp` and `/run` are per node, and with
Slurm's `job_container/tmpfs` plugin `/tmp` and `/dev/shm` are even per job, removed when it
ends (slurm job_container.conf(5): "mounts a list of directories (defaults to /tmp and
/dev/shm)... When the job completes... all files therein are automatically removed"); a
site's node-local scratch (`/local`, `/scratch/local`, `/localscratch`, `/lscratch`,
`/mnt/local`) is on the node's own disk. A requeue lands on other nodes and a restarted group
reads rank 0's checkpoint on every node: from any of these, it starts from step 0. And no target
expands variables in `checkpoint.dir` (`$TMPDIR/ckpt`, `~/ckpt` would be directories named
`$TMPDIR` and `~`), so those are refused wherever the job runs.

`checkpoint.ephemeral: true` opts out: the user accepts that a restart starts over.
"""

from __future__ import annotations

import posixpath

from deploy.problems import Problem
from deploy.spec import JobSpec

OPT_OUT = "or set checkpoint.ephemeral: true to accept starting over after a restart"

#: Host directories that live on one node (or, with Slurm's job_container/tmpfs, one job).
NODE_LOCAL = ("/dev/shm", "/tmp", "/var/tmp", "/run", "/var/run", "/local", "/scratch/local",
              "/localscratch", "/lscratch", "/local_scratch", "/mnt/local")


def node_local(path: str) -> str | None:
    """The node-local directory `path` (absolute, normalised) is at or under, or None."""
    return next((d for d in NODE_LOCAL if under(path, d)), None)


def _node_local_problem(job: JobSpec, path: str, host: str, where: str,
                        fix: str = "put it on the cluster's shared filesystem (a relative "
                        "checkpoint.dir is under the submit directory)") -> list[Problem]:
    local = node_local(host)
    if local is None:
        return []
    return [Problem("checkpoint.dir", f"{path} is {where}{local}, which is node-local (per node, "
                    f"and per job under Slurm's job_container/tmpfs): a restart on other nodes "
                    f"starts from step 0 ({_why(job)})",
                    f"{fix}, {OPT_OUT}")]


def _unexpanded(job: JobSpec) -> list[Problem]:
    """`$VAR` and `~` in checkpoint.dir: the trainer takes the path literally on every target."""
    raw = job.checkpoint.dir
    if "$" in raw or raw.startswith("~"):
        return [Problem("checkpoint.dir", f"{raw!r}: no target expands $VARIABLES or ~ in it "
                        "(the trainer would create a directory named so)",
                        "write the path out in full (e.g. /lustre/alice/ckpt)")]
    return []


def needs_durable_checkpoints(job: JobSpec) -> bool:
    """Something restarts the job or several nodes resume from one checkpoint, and the
    checkpoints are the built-in trainer's (a `script`/`module` keeps its own)."""
    own_code = job.script is not None or job.module is not None
    return not own_code and (job.nodes.max > 1 or job.restarts > 0)


def checkpoint_path(job: JobSpec) -> str:
    """The checkpoint directory as the trainer resolves it: a relative `checkpoint.dir` is
    under `<train.output_dir>/<run id>` in the working directory."""
    path = job.checkpoint.dir
    if not posixpath.isabs(path):
        path = posixpath.join(job.train.output_dir, job.name, path)
    return posixpath.normpath(path)


def under(path: str, mount: str) -> bool:
    mount = mount.rstrip("/") or "/"
    return path == mount or path.startswith(mount.rstrip("/") + "/")


def _why(job: JobSpec) -> str:
    reasons = []
    if job.nodes.max > 1:
        reasons.append(f"{job.nodes.max} nodes resume from it")
    if job.restarts:
        reasons.append(f"restarts: {job.restarts}")
    return " and ".join(reasons)


def k8s_problems(job: JobSpec) -> list[Problem]:
    if _unexpanded(job):
        return _unexpanded(job)
    if job.checkpoint.ephemeral or not needs_durable_checkpoints(job):
        return []
    path = checkpoint_path(job)
    if not posixpath.isabs(path):
        return [Problem("checkpoint.dir", f"{path!r} is in the container's working directory on "
                        f"Kubernetes, lost when a pod restarts ({_why(job)})",
                        "put it on a volume: e.g. a claim mounted at /ckpt and checkpoint.dir: "
                        f"/ckpt/{job.name}, {OPT_OUT}")]
    volumes = sorted((v for v in job.volumes if under(path, v.mount)), key=lambda v: -len(v.mount))
    if not volumes:
        return [Problem("checkpoint.dir", f"{path} is on no volume: it lives in the container and "
                        f"is lost when a pod restarts ({_why(job)})",
                        f"mount a claim, nfs or host_path volume at or above it, {OPT_OUT}")]
    volume = volumes[0]
    if volume.empty_dir is not None:
        return [Problem("checkpoint.dir", f"{path} is on empty_dir volume {volume.name}, which "
                        f"belongs to one pod and is lost when it is recreated ({_why(job)})",
                        f"use a claim, nfs or host_path volume, {OPT_OUT}")]
    if volume.read_only:
        return [Problem("checkpoint.dir", f"{path} is on volume {volume.name}, mounted read-only",
                        f"remove read_only from volume {volume.name} or move checkpoint.dir")]
    if volume.host_path is not None:
        host = posixpath.join(volume.host_path, posixpath.relpath(path, volume.mount))
        return _node_local_problem(job, path, host, f"on host_path volume {volume.name}, in "
                                   "the node's ", "use a claim or nfs volume, or a host_path on "
                                   "a filesystem every node mounts")
    return []


def slurm_problems(job: JobSpec) -> list[Problem]:
    if _unexpanded(job):
        return _unexpanded(job)
    if job.checkpoint.ephemeral or not needs_durable_checkpoints(job):
        return []
    path = checkpoint_path(job)
    if not posixpath.isabs(path):
        return []  # under the submit directory, on the host (mounted into containers)
    s = job.slurm
    if s.container == "none":
        for volume in job.volumes:
            if (volume.host_path is not None and under(path, volume.mount)
                    and volume.host_path != volume.mount):
                return [Problem("checkpoint.dir", f"{path} is under the mount of volume "
                                f"{volume.name}, but without a container nothing mounts its "
                                f"host_path {volume.host_path} there ({_why(job)})",
                                f"give checkpoint.dir under {volume.host_path}, {OPT_OUT}")]
        return _node_local_problem(job, path, path, "in ")
    mounts = [m.split(":") for m in s.container_mounts]
    mounts += [[v.host_path, v.mount] + (["ro"] if v.read_only else [])
               for v in job.volumes if v.host_path is not None]
    covering = sorted((m for m in mounts if under(path, m[1])), key=lambda m: -len(m[1]))
    if not covering:
        return [Problem("checkpoint.dir", f"{path} is inside the {s.container} container: no "
                        f"mount covers it, so it is lost when the job ends ({_why(job)})",
                        f"mount shared storage there (slurm.container_mounts: ['/SHARED/PATH:{path}']), "
                        f"use a relative checkpoint.dir (under the submit directory), {OPT_OUT}")]
    if covering[0][2:] == ["ro"]:
        return [Problem("checkpoint.dir", f"{path} is on the read-only mount {':'.join(covering[0])}",
                        "mount it read-write or move checkpoint.dir")]
    src, dst = covering[0][:2]
    host = posixpath.normpath(posixpath.join(src, posixpath.relpath(path, dst)))
    return _node_local_problem(job, path, host, f"on the mount {src}:{dst}, from the host's ")
