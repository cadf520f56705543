"""`make test`: the whole suite as two pytest sessions side by side.

The Kubernetes testbed's tier (`K8S_TESTBED_MODULES` in tests/conftest.py) mostly waits: on
pods, controllers, a node's NotReady, Kueue's admission (load about 1 on the 2-core CI
machine); the rest is CPU-bound trainer runs. One after the other they took about 40 + 27-35
minutes; side by side, the wall time is the longer of the two (a whole warm `.ci/run`: 46 min,
the rest 44.5, the Kubernetes tier 35.4 beside it). The Kubernetes tier waits on
`k8s/testbed/build.sh`'s lock while a cold build is still compiling.

The Kubernetes tier writes to `.pytest-k8s-tier.log` (printed after the other tier's output,
and while it runs with `tail -f`); the exit status is the worse of the two. With arguments
(`python -m tests.run -k lint`), or `DDPKIT_TEST_SERIAL=1`, it is one plain pytest session
(`make test-serial`: the whole suite so).

Side by side, every timing-bound test has less slack: its first whole trial (session 11) found
the testbed's training-operator exiting on a loaded machine (it could start before its webhook
certificate was copied in: fixed in cluster.sh, and a failed `up` is tried once more); the
second (session 12) passed whole.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import K8S_TESTBED_MODULES, testbed_order

REPO = Path(__file__).resolve().parent.parent
LOG = REPO / ".pytest-k8s-tier.log"
#: Run first in the Kubernetes tier's session too: the Docker testbed's tests (several minutes,
#: mostly waiting on image builds and containers), which then no longer build images while the
#: Kubernetes tier builds its own, and the watchdog's (~4 min on a loaded machine). They balance
#: the two sessions (a warm CI run with only the Docker tests here: the rest 55 min, the
#: Kubernetes tier 47 beside it); on a cold machine they run while build.sh still compiles.
BESIDE_FIRST = ["test_docker_e2e.py", "test_watchdog.py"]


def main(argv: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest"]
    if argv or os.environ.get("DDPKIT_TEST_SERIAL"):
        return subprocess.call(pytest + argv, cwd=REPO)
    k8s_tier = [f"tests/{name}" for name in
                BESIDE_FIRST + sorted(K8S_TESTBED_MODULES, key=lambda n: (testbed_order(n), n))]
    print(f"tests/run.py: the Kubernetes tier ({len(k8s_tier)} modules, the Docker testbed's first) runs beside "
          f"the rest; its output: {LOG.name}",
          flush=True)
    with LOG.open("w") as log:
        beside = subprocess.Popen(pytest + ["-p", "no:cacheprovider", *k8s_tier], cwd=REPO,
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            rest = subprocess.call(pytest + [arg for m in k8s_tier for arg in ("--ignore", m)], cwd=REPO)
            k8s = beside.wait()
        finally:
            if beside.poll() is None:  # interrupted: the tier's session fixtures take the testbed down
                beside.terminate()
                beside.wait()
    print(f"\n--- the Kubernetes tier ({LOG.name}), exit {k8s}:", flush=True)
    sys.stdout.write(LOG.read_text(errors="replace"))
    print(f"--- tests/run.py: the rest exited {rest}, the Kubernetes tier {k8s}", flush=True)
    return rest or k8s


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
