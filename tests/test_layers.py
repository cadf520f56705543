"""The floors of the code (docs/development.md "How it works"): every import of ddpkit's own
modules, at module level or inside a function, goes to the same floor or one below; no import circle;
`trainer` never imports `deploy`, and `deploy` imports torch nowhere. Read from the source
with `ast`, so a new module must be given its floor here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

#: Lowest first. A module's floor is that of the longest prefix listed.
FLOORS = [
    ["trainer"],
    ["deploy", "deploy.errors", "deploy.units", "deploy.kube"],
    ["deploy.problems", "deploy.yamlfile", "deploy.image_forms"],
    ["deploy.lint", "deploy.lint.report", "deploy.lint.meta", "deploy.lint.core", "deploy.lint.cel",
     "deploy.lint.schema"],
    ["deploy.spec"],
    ["deploy.load", "deploy.progress", "deploy.durability", "deploy.docs", "deploy.image", "deploy.testbed"],
    ["deploy.k8s", "deploy.slurm"],
    ["deploy.lint.admission", "deploy.lint.advice", "deploy.lint.command", "deploy.targets", "deploy.run"],
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
    """ddpkit modules `path` imports (outside `if TYPE_CHECKING:`), resolved to modules."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and getattr(node.test, "id", "") == "TYPE_CHECKING" for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
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


def test_no_import_circle():
    """Module-level imports only: a circle there breaks `import` itself."""
    top_level = {}
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        names = set()
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("deploy", "trainer"):
                names |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in GRAPH else node.module
                          for a in node.names}
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names if a.name in GRAPH}
        top_level[module_name(path)] = {n for n in names if n in GRAPH and n != module_name(path)}

    def visit(module: str, stack: list[str]) -> None:
        if module in stack:
            raise AssertionError("import circle: " + " -> ".join(stack[stack.index(module):] + [module]))
        for target in top_level.get(module, ()):
            if target not in done:
                visit(target, [*stack, module])
        done.add(module)

    done: set[str] = set()
    for module in sorted(top_level):
        visit(module, [])
