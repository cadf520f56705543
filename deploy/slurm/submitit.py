"""`--via submitit`: the job's SbatchRequest mapped onto submitit's SlurmExecutor.

submitit writes its own sbatch script (`submitit.slurm.slurm._make_sbatch_string`): the same
#SBATCH options as ddpkit's script (`parameters`), the request's setup and exports as its setup
lines, the request's step options as its srun arguments; then every task runs `SlurmLaunch`,
which sets the request's launch contract and runs its argv (in its Apptainer prefix).
Nothing here restates a directive, a setup line, the container command or the launch env.

Where submitit's script differs from ddpkit's, it is submitit's own way (tests/test_slurm_submit.py
compares the two texts): its log files in its folder, `--signal=USR2@N` to every task (not
`B:` to the batch shell, which runs no trap here), `--time` in minutes, `--wckey=submitit`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from deploy.problems import Problem
from deploy.slurm.request import SbatchRequest
from trainer.contract import LAUNCH_ARGV, LaunchEnv, slurm_port

#: Directives submitit writes from its own parameters: its log files (the batch's and, through
#: its srun, each task's, in its folder) and the stop signal (signal_delay_s).
SUBMITIT_WRITES = frozenset({"output", "error", "signal"})
#: ddpkit's directives that submitit has a parameter for, named with underscores; every other
#: one (open-mode, requeue, extra_directives) goes through its additional_parameters.
NAMED = frozenset({"job-name", "nodes", "ntasks-per-node", "cpus-per-task", "gpus-per-node", "gres",
                   "mem", "time", "partition", "account", "qos", "constraint", "exclusive"})


def problems(job) -> list[Problem]:
    """What `--via submitit` cannot do the way the sbatch script does."""
    out = []
    if job.slurm.container == "pyxis":
        out.append(Problem(
            "slurm.container", "pyxis puts submitit's own srun step in the container, which "
            "would need submitit and ddpkit installed in the image", "use --via sbatch, or "
            "slurm.container: apptainer"))
    if job.time_limit is None:
        out.append(Problem(
            "time_limit", "not set, and submitit then asks Slurm for 5 minutes (its default "
            "--time), which it also counts its timeouts from", "set time_limit, or use --via "
            "sbatch (the partition's default limit)"))
    if job.slurm.signal != "USR2":
        out.append(Problem(
            "slurm.signal", f"{job.slurm.signal}: submitit always asks Slurm for SIGUSR2 before "
            "the time limit", "leave slurm.signal at USR2 or use --via sbatch"))
    if job.slurm.spare_nodes:
        out.append(Problem(
            "slurm.spare_nodes", f"{job.slurm.spare_nodes}: restarting the step inside the allocation "
            "is done by ddpkit's batch script, and submitit writes its own", "use --via sbatch, "
            "or slurm.spare_nodes: 0"))
    return out


def parameters(request: SbatchRequest, workdir: str | os.PathLike) -> dict:
    """`SlurmExecutor.update_parameters` arguments for `request`, submitted from `workdir`."""
    additional: dict = {"chdir": str(workdir)}  # sbatch --chdir, as `submit` gives the script
    params: dict = {"setup": [*request.setup, *request.exports], "srun_args": list(request.step),
                    "signal_delay_s": request.launch_env.stop_grace_s,
                    "additional_parameters": additional}
    for name, value in request.directives:
        if name in SUBMITIT_WRITES:
            continue
        if name == "nodes" and isinstance(value, str):  # elastic MIN-MAX: submitit counts tasks
            params["nodes"], additional["nodes"] = int(value.split("-")[0]), value  # from MIN
        elif name == "time":  # D-HH:MM:SS, whole minutes: submitit's time is minutes
            days, clock = str(value).split("-")
            hours, minutes, _ = clock.split(":")
            params["time"] = int(days) * 1440 + int(hours) * 60 + int(minutes)
        elif name in NAMED:
            params[name.replace("-", "_")] = value
        else:
            additional[name] = value
    return params


def executor(request: SbatchRequest, workdir: str | os.PathLike):
    """submitit's SlurmExecutor for `request`: its folder under the log dir, this interpreter
    (the venv ddpkit runs in) for its own process on every task."""
    import submitit

    # submitit requeues a checkpointable function on timeout at most max_num_timeout times
    executor = submitit.SlurmExecutor(folder=Path(workdir) / request.log_dir / "submitit",
                                      python=sys.executable,
                                      max_num_timeout=request.launch_env.max_restarts)
    executor.update_parameters(**parameters(request, workdir))
    return executor


class SlurmLaunch:
    """What submitit runs on every task: the request's launch contract, then its argv.

    Like the sbatch script: master = first node, port from the job id, the job YAML written
    next to the logs. Runs the entry point as a child process (deploy never imports torch) and
    forwards SIGUSR2/SIGTERM to it; a non-zero exit raises, so submitit reports a failure.

    Preemption: submitit asks Slurm for SIGUSR2 before the time limit. It is forwarded to the
    trainer, which checkpoints and stops; then, with `slurm.requeue`, submitit's own handler
    runs: on rank 0 it calls `checkpoint()` (this object again: the trainer resumes from its
    checkpoint) and requeues the job with `scontrol requeue`.
    """

    def __init__(self, request: SbatchRequest):
        self.request = request

    def checkpoint(self, *args, **kwargs):
        """submitit's hook on preemption: run this same launch again (None: do not requeue)."""
        if not self.request.requeue:
            return None
        import submitit

        return submitit.helpers.DelayedSubmission(self)

    def job_dir(self) -> str:
        """The resolved log directory (the script's `$job_dir`)."""
        return str(Path(self.request.log_dir).resolve())

    def launch_env(self, env: Mapping[str, str]) -> LaunchEnv:
        """The launch contract of a task whose Slurm environment is `env`: the request's
        LaunchEnv with what only the running job knows (trainer.launch's first Slurm host)."""
        from trainer.launch.plan import slurm_first_host

        job_id = env["SLURM_JOB_ID"]
        return replace(self.request.launch_env, job_file=self.request.job_file(self.job_dir(), job_id),
                       nnodes=env["SLURM_JOB_NUM_NODES"], master_addr=slurm_first_host(env),
                       master_port=slurm_port(int(job_id)))

    def environment(self, env: Mapping[str, str]) -> dict[str, str]:
        """The DDPKIT_* variables for a task whose Slurm environment is `env`."""
        return self.launch_env(env).to_env()

    def argv(self) -> list[str]:
        """The request's argv in its container; without one, ddpkit's entry point runs in this
        interpreter (submitit's python, the venv ddpkit submitted from)."""
        request = self.request
        if request.apptainer is not None:  # the container's own python
            return [*request.apptainer.argv(self.job_dir()), *request.argv]
        if request.argv == LAUNCH_ARGV:
            return [sys.executable, *LAUNCH_ARGV[1:]]
        return list(request.argv)

    def __call__(self) -> int:
        import signal

        launch = self.launch_env(os.environ)
        job_file = Path(launch.job_file)
        job_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = job_file.with_name(f".{job_file.name}.{os.getpid()}")
        tmp.write_text(self.request.job_yaml, encoding="utf-8")
        os.replace(tmp, job_file)  # every task writes the same text; replace is atomic
        argv = self.argv()
        submitit_handler = signal.getsignal(signal.SIGUSR2)
        env, cwd = {**os.environ, **launch.to_env()}, None
        if self.request.workdir is not None:  # the snapshot `submit` copied beside the logs
            from deploy.workdir import record_env

            env.update(record_env(self.request.workdir))
            cwd = Path(self.job_dir()) / self.request.workdir_dir
        child = subprocess.Popen(argv, env=env, cwd=cwd)
        stopped: list[int] = []

        def forward(signum, _frame):
            stopped.append(signum)
            child.send_signal(signum)

        for sig in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, forward)
        rc = child.wait()
        if rc != 0 and signal.SIGUSR2 in stopped and self.request.requeue and callable(submitit_handler):
            # checkpointed and stopped: submitit requeues (rank 0) and exits this process
            submitit_handler(signal.SIGUSR2, None)
            return rc
        if rc != 0:
            raise RuntimeError(f"{' '.join(argv)} exited with code {rc}")
        return rc
