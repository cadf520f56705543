"""Wheel build hook: ship the Jinja2 templates (`slurm/**/*.j2`) inside the package as
`deploy/_templates/...`, and nothing else (k8s/ holds the Kubernetes testbed and kind scripts,
for CI and development, not for a user's `pip install`; Kubernetes objects are built as data in
deploy/k8s/)."""

from __future__ import annotations

from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

TEMPLATE_DIRS = ("slurm",)


class TemplatesHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        if version == "editable":  # an editable install reads the templates from the checkout
            return
        root = Path(self.root)
        for kind in TEMPLATE_DIRS:
            for path in sorted((root / kind).rglob("*.j2")):
                relative = path.relative_to(root / kind).as_posix()
                build_data["force_include"][str(path)] = f"deploy/_templates/{kind}/{relative}"
