"""The fault corpus (docs/faults.md "Why did it fail?"): each kind run for real on its targets by the
tests that own it, then read back: did `ddpkit why` name the right cause (N of N), how long
after the job's end it answered, and how long after the fault the hang was found (the hang
watchdog, or the collective timeout it replaces: `train.timeout_s`, 600 s by default).

The figures come from the tests' own output (`-s`): `why answered in X s` / `why answered X s
after the end`, `verdict after A s` / `found A s after rank 3 stopped`. Nothing is timed twice.

    python bench/fault_corpus.py [--targets local slurm k8s]   # root for the testbeds
    python bench/fault_corpus.py --targets local --tests tests/test_watchdog.py --merge   # a rerun
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import REPO, Result, results_dir  # noqa: E402

COLLECTIVE_TIMEOUT_S = 600  # train.timeout_s's default: when a hang would end without the watchdog
#: target -> (pytest node ids, the environment that lets them run)
TESTS = {
    "local": (["tests/test_why.py", "tests/test_watchdog.py"], {}),
    "slurm": (["tests/test_slurm_e2e.py::test_the_fault_corpus_on_slurm",
               "tests/test_slurm_e2e.py::test_why_names_the_exception_and_its_node",
               "tests/test_slurm_e2e.py::test_preempted_job_checkpoints_requeues_resumes_and_never_reruns",
               "tests/test_slurm_e2e.py::test_a_lost_node_requeues_and_resumes_or_ends_the_job_as_restarts_say[0-ddpkit-node2]"],
              {"DDPKIT_SLURM_E2E": "1"}),
    "k8s": (["tests/test_k8s_e2e.py::test_the_fault_corpus_on_kubernetes",
             "tests/test_k8s_e2e.py::test_status_says_why_pods_wait_in_the_schedulers_words"],
            {"DDPKIT_K8S_E2E": "1"}),
}
_WHY = re.compile(r"(?:(\S+): )?(?:`?why`? answered (?:in )?|why after )([\d.]+)s")
_FOUND = re.compile(r"(?:(\S+): )?(?:verdict after|found) ([\d.]+) ?s")


def run(target: str, out_dir: Path, only: list[str] | None = None) -> list[dict]:
    ids, env = TESTS[target]
    ids = only or ids
    xml = out_dir / f"{target}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow or not slow",
           f"--junitxml={xml}", "-o", "junit_logging=system-out", *ids]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **env})
    rows = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        out = "".join(e.text or "" for e in case.iter("system-out"))  # what the test printed
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped") is not None
        whys = [(m.group(1), float(m.group(2))) for m in _WHY.finditer(out)]
        found = [(m.group(1), float(m.group(2))) for m in _FOUND.finditer(out)]
        rows.append({"target": target, "test": case.get("name"), "seconds": float(case.get("time") or 0),
                     "result": "skipped" if skipped else "FAILED" if failed else "passed",
                     "why_s": [s for _, s in whys], "found_s": found})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", nargs="+", choices=list(TESTS), default=list(TESTS))
    p.add_argument("--tests", nargs="+", metavar="NODEID", help="run these of one target instead of all")
    p.add_argument("--merge", action="store_true",
                   help="keep the previous result's rows of the tests not run now (a rerun of some)")
    args = p.parse_args()
    if args.tests and len(args.targets) != 1:
        p.error("--tests needs exactly one --targets")
    result = Result("fault_corpus", "Fault corpus: `ddpkit why` right on every kind, and how fast")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [row for target in args.targets for row in run(target, Path(tmp), args.tests)]
    previous = results_dir() / "fault_corpus.json"
    if args.merge and previous.exists():
        now = {(r["target"], r["test"]) for r in rows}
        kept = [r for r in json.loads(previous.read_text())["data"]["rows"] if (r["target"], r["test"]) not in now]
        rows = kept + rows
        result.note(f"{len(kept)} rows kept from the previous run; {len(now)} rerun now")
    ran = [r for r in rows if r["result"] != "skipped"]
    right = [r for r in ran if r["result"] == "passed"]
    result.table("Each test (a kind or a batch of kinds): result, its `why` answer times, hang detection",
                 ["target", "test", "result", "test s", "why answered (s)", "hang found after (s)"],
                 [[r["target"], r["test"], r["result"], f"{r['seconds']:.0f}",
                   ", ".join(f"{s:.1f}" for s in r["why_s"]) or "-",
                   ", ".join(f"{n + ' ' if n else ''}{s:.0f}" for n, s in r["found_s"]) or "-"] for r in rows])
    whys = [s for r in ran for s in r["why_s"]]
    found = [s for r in ran for _, s in r["found_s"]]
    summary = [["tests passed (each asserts `why`'s category and evidence)", f"{len(right)} of {len(ran)}"],
               ["`why` answers timed", str(len(whys))],
               ["slowest `why` answer after a job's end", f"{max(whys):.1f} s" if whys else "-"],
               ["hangs found (watchdog)", str(len(found))],
               ["slowest detection / collective timeout it replaces",
                f"{max(found):.0f} s / {COLLECTIVE_TIMEOUT_S} s" if found else "-"]]
    result.table("Summary", ["figure", "value"], summary)
    result.doc["data"] = {"rows": rows}
    if not ran:
        result.skip("no test ran (the testbeds need root, and DDPKIT_*_E2E is set here)")
    result.save()
    return 0 if len(right) == len(ran) else 1


if __name__ == "__main__":
    sys.exit(main())
