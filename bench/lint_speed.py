"""Lint time per manifest: where `ddpkit lint` spends it, per layer, and per whole process.

Prints medians (ms) for each flavor of examples/quickstart-2node: reading the workload's CRD
(libyaml vs the JSON cache lint keeps), the custom-resource schema check (pruning, defaults,
jsonschema + CEL), the admission webhook port, the core/pod validation and the advice; then the
whole-process wall time of `ddpkit lint FILE` (what a user waits for), with a cold and a warm
CRD cache; then the per-file time over the lint corpus (tests/lint_corpus), in one process.

Usage: python bench/lint_speed.py [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from deploy.k8s import render as k8s  # noqa: E402
from deploy.kube import core  # noqa: E402
from deploy.lint import advice, schema  # noqa: E402
from deploy.lint import command as lint  # noqa: E402
from deploy.lint.admission import WEBHOOKS  # noqa: E402
from deploy.load import load_job  # noqa: E402
from deploy.yamlfile import load_documents  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def wall_ms(args: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "deploy", "lint", *args], cwd=REPO, env=env, check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return (time.perf_counter() - start) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")

    crds = lint.load_crds()
    job = load_job(str(REPO / "examples" / "quickstart-2node.yaml"))
    print(f"{'flavor':<11} {'CRD yaml':>9} {'CRD json':>9} {'schema':>8} {'webhook':>8} {'core/pod':>9} "
          f"{'advice':>7} {'process cold':>13} {'process warm':>13}")
    for flavor in k8s.FLAVORS:
        objects = k8s.render_objects(job, flavor=flavor)
        obj = next(o for o in objects if o["kind"] not in ("ConfigMap", "Service"))
        group = obj["apiVersion"].rpartition("/")[0]
        t_yaml = t_json = t_schema = t_hook = 0.0
        if not core.is_core(obj["apiVersion"]):
            crd = crds.lookup(obj["apiVersion"], obj["kind"])
            crd_file = next(f for f in schema.crd_files(schema.BUNDLED_CRDS) if obj["kind"].lower() in f.name)
            text = crd_file.read_text()
            t_yaml = median_ms(lambda t=text: load_documents(t), 1)
            t_json = median_ms(lambda f=crd_file, t=text: schema._cached_documents(f, t), args.repeats)
            t_schema = median_ms(lambda o=obj, c=crd: schema.check_custom_resource(o, c["schema"]), args.repeats)
            pruned, _ = schema.check_custom_resource(obj, crd["schema"])
            hook = WEBHOOKS[(group, obj["kind"])]
            ctx = lint.LintRun(crds)
            t_hook = median_ms(lambda p=pruned, h=hook, c=ctx: h.validate(p, c.find_runtime), args.repeats)
            t_core = median_ms(lambda o=obj: [core.validate_pod_template(t, p) for p, t, _ in advice.pod_templates(o)],
                               args.repeats)
        else:
            version = core.resolve_version(None)
            t_core = median_ms(lambda o=obj, v=version: core.validate_core(o, v), args.repeats)
        t_advice = median_ms(lambda o=obj: advice.advise(o), args.repeats)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "job.yaml"
            path.write_text(k8s.render_k8s(job, flavor=flavor))
            env = {**os.environ, "XDG_CACHE_HOME": str(Path(tmp) / "cache")}
            cold = wall_ms([str(path)], env)
            warm = statistics.median(wall_ms([str(path)], env) for _ in range(args.repeats))
        print(f"{flavor:<11} {t_yaml:>7.0f}ms {t_json:>7.1f}ms {t_schema:>6.1f}ms {t_hook:>6.2f}ms "
              f"{t_core:>7.1f}ms {t_advice:>5.2f}ms {cold:>11.0f}ms {warm:>11.0f}ms")

    corpus = sorted((REPO / "tests" / "lint_corpus").rglob("*.yaml"))
    if corpus:
        texts = [(str(f), f.read_text()) for f in corpus]
        ctx = lint.LintRun(crds)
        for f, t in texts:  # warm: CRDs parsed once per process
            lint.lint_text(t, ctx, source=f)
        per_file = [median_ms(lambda t=t, f=f: lint.lint_text(t, ctx, source=f), args.repeats) for f, t in texts]
        print(f"corpus: {len(corpus)} files, in one process: median {statistics.median(per_file):.1f} ms/file, "
              f"max {max(per_file):.1f} ms; whole process on all of them: "
              f"{wall_ms([f for f, _ in texts], dict(os.environ)):.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
