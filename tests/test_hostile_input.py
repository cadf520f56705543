"""Hostile strings in a job file: never executed, handed on byte for byte, secrets never written.

Hypothesis builds strings from the pieces that break shells and YAML (`$(...)`, backticks,
quotes, `;`, newlines, `: `, `{`, `#`, `!!python/object`, anchors and aliases, `%`, `\\`) and
puts them in every field that reaches an artifact. Then, for real:
- the rendered sbatch script runs under bash in a sandbox directory (stand-ins for srun and
  scontrol that record their argv and environment): no canary file appears, every env value
  reaches the job step byte for byte (`env -0`), and the job file the script writes parses back
  to exactly the validated job (args, paths and all);
- every Kubernetes flavor's YAML parses back (yaml.safe_load: no tag is ever interpreted) to the
  same env values, annotations, args and embedded job file;
- a field may refuse a value (one clear problem), never accept it and then mangle or run it.
Secrets: a secret_env value from the submitting environment appears in no artifact, no job
file and no log line. YAML bombs and huge files: tests/test_bad_input.py.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from deploy.errors import UserError
from deploy.k8s import render as k8s
from deploy.load import parse_job
from deploy.slurm.render import render_slurm

pytestmark = pytest.mark.slow  # bash and the renderers, 25 examples per property

CANARY = "CANARY"  # every injection attempt tries to create ./CANARY (the sandbox is the cwd)
PIECES = [
    f"$(touch {CANARY})", f"`touch {CANARY}`", f"; touch {CANARY}", f"\ntouch {CANARY}\n",
    f"' ; touch {CANARY} ; '", f'" ; touch {CANARY} ; "', f"&& touch {CANARY}", f"| touch {CANARY}",
    f"${{IFS}}touch${{IFS}}{CANARY}", "$HOME", "${PATH}", "\\", "\\n", "#", "# ", ": ", "{", "}", "[", "]",
    "!!python/object/apply:os.system", "!!python/object:os.system", "&anchor ", "*anchor", "<<: *a",
    "%", "%x", "!", "*", "?", "~", "\t", "'", '"', "\n", "---", "...", "EOF", "DDPKIT_JOB_YAML",
    "null", "yes", "0x1F", "1e3", "é", "漢字", " ", "-", "--flag=1",
]
HOSTILE = st.lists(st.sampled_from(PIECES) | st.text(alphabet="abcXYZ019_-./", max_size=4),
                   min_size=1, max_size=6).map("".join)

FAKE_SRUN = """#!/bin/bash
printf '%s\\0' "$@" > "$FAKE_DIR/srun.args0"
env -0 > "$FAKE_DIR/srun.env0"
"""
FAKE_SCONTROL = """#!/bin/bash
if [[ $1 == show && $2 == hostnames ]]; then printf 'nodeA\\nnodeB\\n'; exit 0; fi
"""


#: Where the sandboxes go: a directory of pytest's own temporary tree (`sandboxes_under`), which
#: pytest prunes, so Hypothesis's hundreds of examples leave nothing behind in /tmp.
SANDBOXES: list[Path] = []


@pytest.fixture(autouse=True, scope="module")
def sandboxes_under(tmp_path_factory):
    SANDBOXES[:] = [tmp_path_factory.mktemp("hostile-sandboxes")]
    yield
    shutil.rmtree(SANDBOXES.pop(), ignore_errors=True)


def sandbox_run(script: str, extra_env: dict[str, str] | None = None) -> tuple[Path, subprocess.CompletedProcess]:
    """Run `script` with bash in a fresh directory (also its cwd); return the directory."""
    d = Path(tempfile.mkdtemp(prefix="sandbox-", dir=SANDBOXES[0]))
    (d / "bin").mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (d / "bin" / name).write_text(text)
        (d / "bin" / name).chmod(0o755)
    (d / "logs").mkdir()
    (d / "job.sbatch").write_text(script)
    env = {"PATH": f"{d / 'bin'}:/usr/bin:/bin", "FAKE_DIR": str(d), "HOME": str(d),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "demo", "SLURM_JOB_NODELIST": "node[A-B]",
           "SLURM_JOB_NUM_NODES": "2", **(extra_env or {})}
    result = subprocess.run(["bash", str(d / "job.sbatch")], cwd=d, env=env, capture_output=True, text=True,
                            timeout=30)
    return d, result


def nul_env(path: Path) -> dict[str, str]:
    items = path.read_bytes().decode("utf-8", "surrogateescape").split("\0")
    return dict(item.split("=", 1) for item in items if "=" in item)


def canaries(d: Path) -> list[str]:
    return [str(p) for p in d.rglob(f"*{CANARY}*")]


def try_parse(data: dict, target: str):
    """The job, or the refusal: the model's, or the target's checks (what its render refuses)."""
    from deploy.problems import refuse
    from deploy.targets import REGISTRY

    try:
        job = parse_job(data)
        refuse(job, REGISTRY[target].check(job, None))
        return job, None
    except UserError as exc:
        return None, exc


BASE = {"name": "demo", "image": "registry.example/example/ddpkit:0.1", "nodes": 2, "procs_per_node": 2,
        "resources": {"cpus_per_node": 4}, "restarts": 1, "time_limit": "30m"}
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def field_of(problem: str) -> str:
    """`job.yaml: checkpoint.dir: ...` -> `checkpoint.dir`."""
    return problem.split(": ")[1] if problem.count(": ") >= 2 else problem.split(":")[0]


def parse_or_drop(data: dict, droppable: dict[str, tuple[str, str]], target: str):
    """Parse `data`; a refusal may only name the path fields in `droppable` (field -> section,
    key), and parsing again without them must succeed: env values and args are data."""
    job, refused = try_parse(data, target)
    if refused is None:
        return job
    assert all("\n" not in p for p in refused.problems)
    assert {field_of(p) for p in refused.problems} <= set(droppable), refused.problems
    for section, key in droppable.values():
        data.get(section, {}).pop(key, None)
    job, refused = try_parse(data, target)
    assert refused is None, refused.problems
    return job


def check_sbatch(job, env: dict[str, str]) -> None:
    script = render_slurm(job)
    d, result = sandbox_run(script)
    note(script)
    assert result.returncode == 0, result.stdout + result.stderr
    assert canaries(d) == [], "injected text was executed"
    seen = nul_env(d / "srun.env0")
    assert {k: seen.get(k) for k in env} == env  # byte for byte into the job step
    job_file = Path(seen["DDPKIT_JOB_FILE"])
    assert yaml.safe_load(job_file.read_text()) == job.model_dump(mode="json")  # args, paths, all
    assert (d / "srun.args0").read_text().split("\0")[:-1][-3:] == ["python", "-m", "trainer.launch"]


PATHS = {"checkpoint.dir": ("checkpoint", "dir"), "train.output_dir": ("train", "output_dir")}


@SETTINGS
@given(values=st.lists(HOSTILE, min_size=1, max_size=3), args=st.lists(HOSTILE, max_size=3),
       ckpt=HOSTILE, out=HOSTILE)
def test_the_sbatch_script_never_runs_injected_text_and_hands_values_on_byte_for_byte(values, args, ckpt, out):
    env = {f"V{i}": v for i, v in enumerate(values)}
    # the built-in trainer with hostile paths; a user module with hostile args
    check_sbatch(parse_or_drop({**BASE, "env": env, "checkpoint": {"dir": ckpt}, "train": {"output_dir": out}},
                               PATHS, "slurm"), env)
    check_sbatch(parse_or_drop({**BASE, "env": env, "module": "my_pkg.train", "args": args}, {}, "slurm"), env)


@SETTINGS
@given(venv=HOSTILE, mounts=st.lists(HOSTILE, max_size=2), image=HOSTILE, setup_data=HOSTILE)
def test_container_paths_and_images_are_quoted_or_refused(venv, mounts, image, setup_data):
    """pyxis/apptainer settings and a venv reach bash lines: quoted or refused. `slurm.setup`
    lines are shell by design and run exactly as written (here one that writes a quoted value)."""
    for container in ("none", "pyxis", "apptainer"):
        data = {**BASE, "image": image,
                "slurm": {"container": container, "container_mounts": mounts,
                          "setup": [f"printf '%s' {shlex.quote(setup_data)} > setup.out"],
                          **({"venv": venv} if container == "none" else {})}}
        job, refused = try_parse(data, "slurm")
        if refused is not None:
            assert all("\n" not in p for p in refused.problems)
            continue
        script = render_slurm(job)
        d, result = sandbox_run(script)
        note(script)
        assert canaries(d) == [], f"{container}: injected text was executed"
        if container == "none":  # pyxis/apptainer need real binaries; here bash must at least not run the canary
            assert result.returncode == 0, result.stdout + result.stderr
            assert (d / "setup.out").read_text() == setup_data


@SETTINGS
@given(values=st.lists(HOSTILE, min_size=1, max_size=3), notes=st.lists(HOSTILE, max_size=2),
       args=st.lists(HOSTILE, max_size=3), ckpt=HOSTILE)
def test_kubernetes_yaml_parses_back_to_exactly_the_input(values, notes, args, ckpt):
    env = {f"V{i}": v for i, v in enumerate(values)}
    annotations = {f"example.com/n{i}": v for i, v in enumerate(notes)}
    # one node, no restarts: a checkpoint in the container's working directory is fine then
    base = {**BASE, "nodes": 1, "restarts": 0, "k8s": {"annotations": annotations}}
    for job in (parse_or_drop({**base, "env": env, "checkpoint": {"dir": ckpt}}, PATHS, "k8s"),
                parse_or_drop({**base, "env": env, "module": "my_pkg.train", "args": args}, {}, "k8s")):
        check_k8s(job, env, annotations)


def check_k8s(job, env: dict[str, str], annotations: dict[str, str]) -> None:
    rendered = 0
    for flavor in k8s.FLAVORS:
        try:
            text = k8s.render_k8s(job, flavor=flavor)
        except UserError:
            continue
        rendered += 1
        docs = list(yaml.safe_load_all(text))  # safe: a tag in a value would raise here
        assert yaml.safe_load(docs[0]["data"]["job.yaml"]) == job.model_dump(mode="json")
        env_lists = [e for e in _env_lists(docs) if any(v.get("name") == "DDPKIT_RUN_ID" for v in e)]
        assert env_lists, flavor
        for entries in env_lists:  # every trainer container (or TrainJob trainer) gets the values
            values_seen = {e["name"]: e.get("value") for e in entries}
            # Kubernetes expands $(VAR) in env values: the renderer escapes `$` as `$$`
            assert {k: values_seen[k].replace("$$", "$") for k in env} == env
        for pod in _pod_specs(docs):
            assert {k: pod["metadata"]["annotations"][k] for k in annotations} == annotations
    assert rendered >= 1


def _env_lists(docs: list[dict]) -> list[list[dict]]:
    out = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("env"), list):
                out.append(node["env"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for doc in docs:
        walk(doc)
    return out


def _pod_specs(docs: list[dict]) -> list[dict]:
    """Every pod template in the rendered objects (any flavor), found by shape."""
    out = []

    def walk(node):
        if isinstance(node, dict):
            if "spec" in node and isinstance(node["spec"], dict) and "containers" in node["spec"]:
                out.append(node)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for doc in docs:
        walk(doc)
    return out


def test_secret_values_never_reach_an_artifact_a_job_file_or_a_log(tmp_path):
    secret = "s3cr3t-'$(touch CANARY)'-\"`id`\"-value"
    job = parse_job({**BASE, "secret_env": [{"name": "API_TOKEN", "secret": "tokens", "key": "api"}],
                     "checkpoint": {"ephemeral": True}})
    script = render_slurm(job)
    manifests = [k8s.render_k8s(job, flavor=f) for f in k8s.FLAVORS if not _refuses(job, f)]
    assert manifests and all(secret not in text for text in [script, *manifests, job.to_yaml()])
    for text in manifests:
        assert "secretKeyRef" in text and "api" in text
    d, result = sandbox_run(script, {"API_TOKEN": secret})
    assert result.returncode == 0, result.stdout + result.stderr
    assert canaries(d) == []
    assert nul_env(d / "srun.env0")["API_TOKEN"] == secret  # the job step gets it, from the environment
    written = [p for p in d.rglob("*") if p.is_file() and p.name not in ("srun.env0",)]
    assert all(secret.encode() not in p.read_bytes() for p in written), "a file holds the secret"
    assert secret not in result.stdout + result.stderr


def _refuses(job, flavor: str) -> bool:
    try:
        k8s.render_k8s(job, flavor=flavor)
        return False
    except UserError:
        return True


def test_the_trainer_and_launcher_never_log_a_secret(tmp_path):
    """A real `ddpkit run --local` with the secret in its environment: not in any output,
    metrics, job file or checkpoint the run leaves behind."""
    import sys

    from tests.trainer_util import REPO, launch_env

    secret = "tok-9f1c2e7b-SECRET"
    job = tmp_path / "sec.yaml"
    job.write_text(yaml.safe_dump({"name": "sec", "image": "ddpkit:0.1", "procs_per_node": 2,
                                   "secret_env": [{"name": "API_TOKEN", "secret": "s", "key": "k"}],
                                   "train": {"max_steps": 3, "threads": 1, "eval_every_epochs": 0,
                                             "plot": False, "log_every_steps": 1}}))
    env = {**launch_env(job), "PYTHONPATH": str(REPO), "API_TOKEN": secret}
    result = subprocess.run([sys.executable, "-m", "deploy", "run", str(job), "--local"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert secret not in result.stdout + result.stderr
    files = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()]
    assert files and all(secret.encode() not in p.read_bytes() for p in files)
    assert os.path.exists(tmp_path / "runs" / "sec" / "metrics.jsonl")
