"""`ddpkit lint` agrees with the real API server on a corpus of manifests (tests/lint_corpus/).

The corpus: ddpkit's own renderings (examples x flavors), upstream example manifests (their
source in each file's first line) and broken variants, one per rule. Each file's second line is
the verdict the testbed's API server gave to `kubectl apply --dry-run=server -f FILE` (kubectl's
default strict field validation, the operators' webhooks installed), written by
`python tests/lint_corpus/record.py`: `# server: accepted` or `# server: refused: MESSAGE`.

- offline: lint's verdict (refused = at least one error) equals the recorded one, file by file,
  except the disagreements listed in tests/lint_corpus/README.md (each with its reason);
- live (the Kubernetes testbed up; CI=true fails without it): the server's verdict now equals
  the recorded one and lint's, and every current rendering of every example is accepted.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy.lint import command as lint
from tests.conftest import IN_CI, RENDERINGS, REPO, require

CORPUS = REPO / "tests" / "lint_corpus"
FILES = sorted(CORPUS.rglob("*.yaml"))
K8S_VERSION = "1.34"  # the testbed's kube-apiserver
#: Kinds that must exist before the objects that name them (a TrainJob's runtime): the live
#: check creates them for real first, as `kubectl apply -f FILE` would, then removes them.
PREREQUISITE_KINDS = ("ClusterTrainingRuntime", "TrainingRuntime")


def header(path: Path) -> tuple[str, str]:
    """(source, recorded verdict) from a corpus file's first two lines."""
    lines = path.read_text().splitlines()
    source = lines[0].removeprefix("# source: ") if lines and lines[0].startswith("# source: ") else ""
    verdict = lines[1].removeprefix("# server: ") if len(lines) > 1 and lines[1].startswith("# server: ") else ""
    return source, verdict


def known_disagreements() -> dict[str, str]:
    """File name -> reason, from the README's table (`| file | reason |` rows under the heading)."""
    text = (CORPUS / "README.md").read_text()
    section = text.split("## Disagreements", 1)[-1]
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| `([^`]+)` \| (.+) \|$", section, re.M)}


_CONTEXT = lint.LintRun(lint.load_crds(), K8S_VERSION)  # the bundled CRDs, parsed once


def lint_verdict(path: Path, text: str | None = None) -> tuple[str, list[lint.LintFinding]]:
    found = lint.lint_text(text if text is not None else path.read_text(), _CONTEXT, source=path.name)
    errors = [p for p in found if p.severity == lint.ERROR]
    return ("refused" if errors else "accepted"), errors


def verdict_word(recorded: str) -> str:
    return recorded.split(":", 1)[0].strip()


def test_corpus_covers_every_source_and_is_recorded():
    sources = {p.parent.name for p in FILES}
    assert sources == {"ddpkit", "upstream", "broken"}
    assert len(FILES) >= 100
    unrecorded = [p.name for p in FILES if verdict_word(header(p)[1]) not in ("accepted", "refused")]
    assert unrecorded == [], f"record them on the testbed: python tests/lint_corpus/record.py ({len(unrecorded)})"
    assert all(header(p)[0] for p in FILES), "every corpus file names its source on its first line"


@pytest.mark.parametrize("path", FILES, ids=[f"{p.parent.name}/{p.name}" for p in FILES])
def test_lint_agrees_with_the_recorded_server_verdict(path):
    recorded = verdict_word(header(path)[1])
    if recorded not in ("accepted", "refused"):
        pytest.fail(f"{path.name}: no server verdict recorded")
    verdict, errors = lint_verdict(path)
    disagreement = known_disagreements().get(path.name)
    if disagreement:
        assert verdict != recorded, f"{path.name} is listed as a disagreement but now agrees: update README"
        return
    assert verdict == recorded, (f"{path.name}: server {header(path)[1]!r}, lint {verdict}: "
                                 + "; ".join(str(e) for e in errors))


# ---- live: the real API server on the Kubernetes testbed ---------------------------------------

def _testbed():
    try:
        from deploy.testbed import k8s as testbed
    except ImportError:
        testbed = None
    require(testbed is not None, "the Kubernetes testbed (deploy.testbed.k8s) is not in this checkout")
    require(os.geteuid() == 0, "the Kubernetes testbed needs root")
    return testbed


@pytest.fixture(scope="module")
def server():
    """The testbed's client environment (the cluster is brought up if it is down, and taken down
    at the end only then)."""
    from tests.test_k8s_conformance import take_lock  # the testbed's lock, shared by its tests

    require(IN_CI or os.environ.get("DDPKIT_K8S_E2E") == "1",
            "live lint-corpus checks run with CI=true or DDPKIT_K8S_E2E=1 (they use the k8s testbed)")
    testbed = _testbed()
    lock = open(f"{testbed.testbed_dir()}.lock", "w")
    take_lock(lock)
    was_up = testbed.status(quiet=True)
    if not was_up:
        testbed.up()
    yield testbed.client_env()
    if not was_up:
        testbed.down()
    lock.close()


def server_verdict(path: Path, env: dict, text: str | None = None) -> str:
    """`kubectl apply --dry-run=server -f FILE`: 'accepted' or 'refused: <first error line>'."""
    text = path.read_text() if text is None else text
    docs = [d for d in yaml.safe_load_all(text) if isinstance(d, dict)]
    prereq = [d for d in docs if d.get("kind") in PREREQUISITE_KINDS] if any(
        d.get("kind") == "TrainJob" for d in docs) else []
    namespaces = sorted({(d.get("metadata") or {}).get("namespace") for d in docs} - {None, "", "default"})
    created = []
    try:
        for ns in namespaces:  # cluster state lint cannot know: the namespaces exist (and are kept:
            # a deleted one stays Terminating for a while and refuses what the next file creates)
            exists = subprocess.run(["kubectl", "get", "namespace", ns], env=env, capture_output=True, timeout=60)
            if exists.returncode != 0:
                subprocess.run(["kubectl", "create", "namespace", ns], env=env, capture_output=True, timeout=60)
        for doc in prereq:
            done = subprocess.run(["kubectl", "create", "-f", "-"], input=yaml.safe_dump(doc), env=env,
                                  capture_output=True, text=True, timeout=60)
            if done.returncode == 0:
                created.append(doc)
        result = subprocess.run(["kubectl", "apply", "--dry-run=server", "-f", "-"], input=text, env=env,
                                capture_output=True, text=True, timeout=120)
    finally:
        for doc in reversed(created):
            subprocess.run(["kubectl", "delete", "--wait=false", "-f", "-"], input=yaml.safe_dump(doc), env=env,
                           capture_output=True, text=True, timeout=60)
    if result.returncode == 0:
        return "accepted"
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error") or line.startswith("error")]
    return "refused: " + (errors[0] if errors else result.stderr.strip().splitlines()[-1])[:400]


@pytest.mark.e2e
@pytest.mark.parametrize("path", FILES, ids=[f"{p.parent.name}/{p.name}" for p in FILES])
def test_lint_agrees_with_the_live_api_server(server, path):
    live = server_verdict(path, server)
    assert verdict_word(live) == verdict_word(header(path)[1]), f"{path.name}: recorded {header(path)[1]!r}, now {live!r}"
    verdict, errors = lint_verdict(path)
    if path.name not in known_disagreements():
        assert verdict == verdict_word(live), f"{path.name}: server {live!r}, lint {verdict}: {errors}"


@pytest.mark.e2e
@pytest.mark.parametrize("example, flavor", RENDERINGS, ids=[f"{e.stem}-{f}" for e, f in RENDERINGS])
def test_every_current_rendering_is_accepted_by_the_server_and_by_lint(server, example, flavor):
    """Every example in every flavor that expresses it (tests/conftest.py REFUSED_RENDERINGS)."""
    from deploy.k8s.render import render_k8s
    from deploy.load import load_job

    text = render_k8s(load_job(str(example)), flavor=flavor, source=example.name)
    assert server_verdict(example, server, text) == "accepted"
    assert lint_verdict(example, text)[0] == "accepted"
