"""Where each fact that targets must agree on is written as a literal in code (docstrings and
comments do not count), in deploy/, trainer/ and the sbatch template of a tree: one place each
is the goal (issue 18). `python bench/facts.py [TREE]` (default: this checkout); run it on an
older checkout (`git worktree add /tmp/old REV`) to compare.
"""

import ast
import re
import sys
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)
FACTS = {
    "launch contract (DDPKIT_* names written)": lambda v: isinstance(v, str) and re.fullmatch(r"DDPKIT_(JOB_FILE|RUN_ID|NNODES|NPROC_PER_NODE|MAX_RESTARTS|LAUNCHER|STOP_GRACE_S|MASTER_ADDR|MASTER_PORT)", v),
    "exit code 143": lambda v: v == 143 and not isinstance(v, bool),
    "exit code 137": lambda v: v == 137 and not isinstance(v, bool),
    "port 29500": lambda v: v in (29500, "29500"),
    "launch argv trainer.launch": lambda v: v == "trainer.launch",
    "Slurm port formula 15000": lambda v: v == 15000,
    "Kubernetes name regexes": lambda v: isinstance(v, str) and "[a-z0-9]([-a-z0-9]*[a-z0-9])?" in v and v.startswith("^"),
    "quantity regexes/factors": lambda v: isinstance(v, str) and "Ki|Mi|Gi" in v,
    "flavor API groups": lambda v: v in ("kubeflow.org", "jobset.x-k8s.io", "trainer.kubeflow.org", "kubeflow.org/v1", "jobset.x-k8s.io/v1alpha2", "trainer.kubeflow.org/v1alpha1"),
}

def docstrings(tree):
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out

counts = {k: [] for k in FACTS}
for top in ("deploy", "trainer"):
    for path in sorted((root / top).rglob("*.py")):
        tree = ast.parse(path.read_text())
        skip = docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and id(node) not in skip:
                for fact, test in FACTS.items():
                    if test(node.value):
                        counts[fact].append(f"{path.relative_to(root)}:{node.lineno}")
for tpl in sorted((root / "slurm").glob("*.j2")):
    text = tpl.read_text()
    for n, line in enumerate(text.splitlines(), 1):
        if "15000" in line:
            counts["Slurm port formula 15000"].append(f"{tpl.relative_to(root)}:{n}")
        if re.search(r"export DDPKIT_(RUN_ID|NNODES|NPROC_PER_NODE|MAX_RESTARTS|LAUNCHER|STOP_GRACE_S)=", line):
            counts["launch contract (DDPKIT_* names written)"].append(f"{tpl.relative_to(root)}:{n}")
for fact, places in counts.items():
    files = sorted({p.split(":")[0] for p in places})
    print(f"{fact:45s} {len(places):3d} literals in {len(files):2d} files  {' '.join(files)}")
