"""Real clusters on this one machine, for trying jobs before a real cluster (and for CI)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

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
