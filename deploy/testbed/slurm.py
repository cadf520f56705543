"""`ddpkit testbed slurm up|down|status|env`: a real two-node Slurm cluster on this machine.

The work is done by `slurm-testbed.sh` next to this file (network and hostname namespaces,
munged, slurmctld, two slurmd); this module installs Debian's packages when they are missing,
runs the script, and tells callers where the client wrappers are. Needs root.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

from deploy.errors import RuntimeFailure, UserError
from deploy.testbed import apt_install, run_action

SCRIPT = Path(__file__).with_name("slurm-testbed.sh")
PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
# the commands slurm-testbed.sh needs from PACKAGES
COMMANDS = ["slurmctld", "slurmd", "sbatch", "munged"]
NODES = ["ddpkit-node1", "ddpkit-node2"]


def testbed_dir() -> Path:
    """Where the cluster keeps its state, logs and client wrappers (same knob as the script)."""
    return Path(os.environ.get("DDPKIT_SLURM_TESTBED_DIR", "/tmp/ddpkit-slurm-testbed"))


def bin_dir() -> Path:
    """Wrappers for sbatch, srun, squeue, scontrol, scancel, ... that reach the cluster."""
    return testbed_dir() / "bin"


def client_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with the testbed's client wrappers first on PATH."""
    env = dict(os.environ if env is None else env)
    env["PATH"] = f"{bin_dir()}{os.pathsep}{env.get('PATH', '')}"
    return env


def _require_root() -> None:
    if os.geteuid() != 0:
        raise UserError("ddpkit testbed slurm needs root (namespaces, daemons): run it with sudo")


def missing_commands() -> list[str]:
    return [c for c in COMMANDS if shutil.which(c) is None]


def ensure_packages() -> None:
    """Install Debian's Slurm and munge packages with apt-get when a command is missing."""
    if not missing_commands():
        return
    apt_install(PACKAGES)
    if missing_commands():
        raise RuntimeFailure(f"still missing after apt-get: {', '.join(missing_commands())}")


def _script(action: str, *, quiet: bool = False) -> int:
    out = subprocess.DEVNULL if quiet else None
    return subprocess.run(["bash", str(SCRIPT), action], stdout=out).returncode


def up() -> None:
    """Bring the cluster up (a no-op when it is already healthy)."""
    _require_root()
    ensure_packages()
    if _script("up") != 0:
        raise RuntimeFailure("the Slurm testbed did not come up (daemon logs above)")


def down() -> None:
    """Stop the daemons and every process in the testbed's namespaces; remove all its state."""
    _require_root()
    if _script("down") != 0:
        raise RuntimeFailure("the Slurm testbed was not removed completely (see above)")


def status(*, quiet: bool = False) -> bool:
    """Print the cluster's state; True when it is up and both nodes answer."""
    _require_root()
    return _script("status", quiet=quiet) == 0


def node_pids(node: str) -> list[int]:
    """PIDs of the processes living in a testbed node's network namespace (slurmd included)."""
    out = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def kill_node(node: str) -> list[int]:
    """A node lost without warning: SIGKILL, no signal first, to its slurmd and every process
    in its namespace (slurmstepd, the job's tasks). Returns the PIDs it killed."""
    pids = node_pids(node)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def start_node(node: str) -> None:
    """Start a node's slurmd again (the node rebooted); returns once slurmctld has it idle."""
    _require_root()
    if subprocess.run(["bash", str(SCRIPT), "node-up", node]).returncode != 0:
        raise RuntimeFailure(f"the Slurm testbed's node {node} did not come back (see above)")


def main(action: str) -> int:
    """The CLI's `testbed slurm ACTION`."""
    return run_action("slurm", action, up=up, down=down, status=status, env_lines=lambda: [
        f"export PATH={shlex.quote(str(bin_dir()))}:\"$PATH\""])
