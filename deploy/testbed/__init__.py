"""Real clusters on this one machine, for trying jobs before a real cluster (and for CI)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable

from deploy.errors import RuntimeFailure, UserError


def apt_install(packages: list[str]) -> None:
    """Install Debian packages with apt-get (fetching the package lists first when a fresh
    machine has none yet)."""
    if shutil.which("apt-get") is None:
        raise UserError(f"missing {' '.join(packages)} and no apt-get: install them with your "
                        "package manager")
    print(f"testbed: installing {' '.join(packages)} with apt-get", file=sys.stderr)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    if subprocess.run(install, env=env, stdout=subprocess.DEVNULL).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL)
        if subprocess.run(install, env=env, stdout=subprocess.DEVNULL).returncode != 0:
            raise RuntimeFailure(f"apt-get install {' '.join(packages)} failed (see above)")


def run_action(kind: str, action: str, *, up: Callable[[], object], down: Callable[[], object],
               status: Callable[[], bool], env_lines: Callable[[], list[str]] | None = None) -> int:
    """The CLI's `testbed KIND ACTION`, the same verbs on every testbed: `status` exits 3 when
    the testbed is not up; `env` prints the lines that point clients at it (where it has any)."""
    actions = ["up", "down", "status", *(["env"] if env_lines else [])]
    if action == "up":
        up()
    elif action == "down":
        down()
    elif action == "status":
        return 0 if status() else 3
    elif action == "env" and env_lines:
        print("\n".join(env_lines()))
    else:
        raise UserError(f"testbed {kind}: unknown action {action!r}: use {', '.join(actions[:-1])} "
                        f"or {actions[-1]}")
    return 0
