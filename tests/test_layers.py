"""The floors of the code (docs/development.md "How it works"): every import of ddpkit's own
modules, at module level, inside a function or under `if TYPE_CHECKING:`, goes to the same floor
or one below; no import circle, whatever kind of import closes it; `trainer` never imports
`deploy`, and `deploy` imports torch nowhere. Read from the source with `ast`, so a new module
must be given its floor here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

#: Lowest first. A module's floor is that of the longest prefix listed.
FLOORS = [
    # trainer/: the contract (standard library only), the worker's parts, the step, the workers'
    # runners, the node's launcher; preflight, an entry that runs the launcher on a node, last.
    ["trainer", "trainer.contract"],
    ["trainer.attempts", "trainer.checkpoint", "trainer.config", "trainer.data", "trainer.forked",
     "trainer.gpus", "trainer.host", "trainer.kubeflow_status", "trainer.plot", "trainer.rank_lines",
     "trainer.stragglers", "trainer.watchdog"],
    ["trainer.dist", "trainer.models", "trainer.progress", "trainer.stop"],
    ["trainer.metrics", "trainer.script_steps", "trainer.script_watch"],
    ["trainer.train", "trainer.__main__"],
    ["trainer.guard", "trainer.warm"],
    ["trainer.launch.plan", "trainer.launch.script_stop"],
    ["trainer.launch.relay", "trainer.launch.supervise"],
    ["trainer.launch", "trainer.launch.node", "trainer.launch.__main__"],
    ["trainer.preflight"],
    # deploy/
    ["deploy", "deploy.errors", "deploy.units", "deploy.kube", "deploy.kube.finding", "deploy.logs", "deploy.why"],
    ["deploy.kube.meta"],
    ["deploy.kube.core", "deploy.problems", "deploy.yamlfile", "deploy.image_forms"],
    ["deploy.spec"],
    ["deploy.load", "deploy.progress", "deploy.durability", "deploy.docs", "deploy.image", "deploy.testbed",
     "deploy.workdir"],
    ["deploy.k8s", "deploy.k8s.pod", "deploy.k8s.controller", "deploy.slurm"],
    ["deploy.k8s.job", "deploy.k8s.jobset", "deploy.k8s.pytorchjob", "deploy.k8s.trainjob"],
    ["deploy.k8s.job.operator", "deploy.k8s.jobset.operator", "deploy.k8s.pytorchjob.operator",
     "deploy.k8s.trainjob.operator"],
    ["deploy.k8s.cluster"],
    ["deploy.k8s.blame"],
    ["deploy.k8s.render", "deploy.k8s.submit"],
    ["deploy.lint", "deploy.targets", "deploy.run"],
    ["deploy.api", "deploy.watch"],
    ["deploy.cli", "deploy.__main__"],
]


def floor_of(module: str) -> int:
    best, floor = -1, None
    for level, names in enumerate(FLOORS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, floor = len(name), level
    assert floor is not None, f"{module}: give it a floor in tests/test_layers.py"
    return floor


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """ddpkit modules `path` imports anywhere (module level, in a function, for type checking
    only), resolved to modules; and torch."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from deploy.k8s import pod` imports deploy.k8s.pod
                sub = f"{node.module}.{alias.name}"
                found.add(sub if (REPO / sub.replace(".", "/")).with_suffix(".py").exists()
                          or (REPO / sub.replace(".", "/")).is_dir() else node.module)
    return {m for m in found if m.split(".")[0] in ("deploy", "trainer", "torch")}


SOURCES = sorted(p for top in ("deploy", "trainer") for p in (REPO / top).rglob("*.py"))
GRAPH = {module_name(p): imports(p) for p in SOURCES}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_go_to_the_same_floor_or_below(module):
    own = floor_of(module)
    for target in sorted(GRAPH[module]):
        if target.split(".")[0] == "torch":
            assert module.startswith("trainer"), f"{module} imports {target}: deploy never imports torch"
            continue
        assert not (module.startswith("trainer") and target.startswith("deploy")), \
            f"{module} imports {target}: trainer never imports deploy"
        assert floor_of(target) <= own, (f"{module} (floor {own}) imports {target} "
                                         f"(floor {floor_of(target)}): up a floor")


def module_of(name: str) -> str | None:
    """The module of ours that an imported name is (or is in): `deploy.k8s.pod.X` -> deploy.k8s.pod."""
    while name and name not in GRAPH:
        name = name.rpartition(".")[0]
    return name or None


def first_circle(edges: dict[str, set[str]]) -> list[str] | None:
    """A circle of `edges` (module -> the modules it imports), or None: a depth-first walk."""
    done: set[str] = set()

    def visit(module: str, stack: list[str]) -> list[str] | None:
        if module in stack:
            return stack[stack.index(module):] + [module]
        for target in sorted(edges.get(module, ())):
            if target not in done and (found := visit(target, [*stack, module])):
                return found
        done.add(module)
        return None

    return next((found for module in sorted(edges) if (found := visit(module, []))), None)


def test_no_import_circle():
    """Every import counts, a function's and a type checker's too: a circle of any kind means
    two modules that each need the other, so neither is below the other."""
    edges = {module: {t for t in map(module_of, targets) if t and t != module}
             for module, targets in GRAPH.items()}
    circle = first_circle(edges)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_circle_check_finds_a_circle():
    assert first_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert first_circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
