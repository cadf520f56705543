"""Where `ddpkit lint` spends its time, per layer, for every flavor of examples/quickstart-2node.

Prints medians (ms) of: reading the CRD directory with libyaml's loader vs the pure-Python one
(why lint.py prefers CSafeLoader), the CRD structural-schema check of one workload object, the
core `kubernetes-validate --strict` check of its pod template(s), and the ddpkit rules; then the
whole-process wall time of `ddpkit lint` on the rendered file.

Usage: python bench/lint_speed.py [--crds DIR] [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from deploy import lint  # noqa: E402
from deploy.render import k8s  # noqa: E402
from deploy.spec import load_job  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--crds", default=str(REPO.parent / "shared" / "crds"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    crd_dir = Path(args.crds)
    if not crd_dir.is_dir():
        raise SystemExit(f"no CRD directory at {crd_dir}; pass --crds DIR")

    files = sorted(crd_dir.glob("*.yaml"))
    c_load = median_ms(lambda: [list(yaml.load_all(f.read_text(), Loader=yaml.CSafeLoader)) for f in files], args.repeats)
    py_load = median_ms(lambda: [list(yaml.load_all(f.read_text(), Loader=yaml.SafeLoader)) for f in files], 1)
    size = sum(f.stat().st_size for f in files) / 1e6
    print(f"read {len(files)} CRD files ({size:.1f} MB): libyaml {c_load:.0f} ms, pure Python {py_load:.0f} ms "
          f"({py_load / c_load:.1f}x)")

    crds = lint.load_crds(crd_dir)
    job = load_job(str(REPO / "examples" / "quickstart-2node.yaml"))
    print(f"{'flavor':<11} {'CRD schema':>11} {'PodTemplate':>12} {'rules':>8} {'ddpkit lint (process)':>22}")
    for flavor in k8s.FLAVORS:
        objects = k8s.render_objects(job, flavor=flavor)
        obj = next(o for o in objects if o["kind"] != "ConfigMap" and o["kind"] != "Service")
        schema = crds.lookup(obj["apiVersion"], obj["kind"])
        t_schema = median_ms(lambda o=obj, s=schema: lint.validate_schema(o, s), args.repeats) if schema else 0.0
        templates = [t for _, t in lint.pod_templates_in(obj)]
        if obj["kind"] == "Job":  # a core kind: kubernetes-validate checks the whole object
            t_core = median_ms(lambda o=obj: lint.core_validate(o), args.repeats)
        else:
            t_core = median_ms(lambda ts=templates: [lint.core_validate(lint.as_pod_template(t)) for t in ts], args.repeats)
        t_rules = median_ms(lambda o=obj: lint.check_rules(o), args.repeats)
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
            fh.write(k8s.render_k8s(job, flavor=flavor))
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "deploy", "lint", fh.name, "--crds", str(crd_dir)],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        wall = (time.perf_counter() - start) * 1000
        Path(fh.name).unlink()
        print(f"{flavor:<11} {t_schema:>9.1f}ms {t_core:>10.1f}ms {t_rules:>6.2f}ms {wall:>20.0f}ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
