"""Record the testbed API server's verdict in the second line of every lint-corpus file.

Usage (root, the Kubernetes testbed up: `python -m deploy testbed k8s up`):
    python tests/lint_corpus/record.py [FILE...]

Each file gets `# server: accepted` or `# server: refused: <kubectl's first error line>` from
`kubectl apply --dry-run=server -f FILE` (see tests/test_lint_corpus.py::server_verdict). Then
it prints the agreement of `ddpkit lint` with those verdicts: the figure docs/kubernetes.md gives.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from deploy.testbed import k8s as testbed  # noqa: E402
from tests.test_lint_corpus import (  # noqa: E402
    FILES,
    header,
    known_disagreements,
    lint_verdict,
    server_verdict,
    verdict_word,
)


def main(argv: list[str]) -> int:
    if not testbed.status(quiet=True):
        print("the Kubernetes testbed is not up: python -m deploy testbed k8s up", file=sys.stderr)
        return 2
    env = testbed.client_env()
    files = [Path(a).resolve() for a in argv] or FILES
    for path in files:
        verdict = server_verdict(path, env)
        lines = path.read_text().splitlines(keepends=True)
        lines[1] = f"# server: {verdict}\n"
        path.write_text("".join(lines))
        print(f"{path.relative_to(REPO)}: {verdict[:160]}")
    agree, disagree = 0, []
    for path in FILES:
        recorded = verdict_word(header(path)[1])
        verdict, errors = lint_verdict(path)
        if verdict == recorded:
            agree += 1
        else:
            disagree.append((path.name, recorded, verdict, [str(e) for e in errors][:2]))
    print(f"\nddpkit lint agrees with the API server on {agree} of {len(FILES)} corpus files")
    listed = known_disagreements()
    for name, recorded, verdict, errors in disagree:
        print(f"  {name}: server {recorded}, lint {verdict}{' (listed)' if name in listed else ''} {errors}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
