"""The CLI as a user runs it: real processes, real exit codes, real files."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deploy.cli import build_parser
from tests.conftest import REPO, cli


def test_init_writes_a_starter_that_validates(tmp_path):
    result = cli("init", "job.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "job.yaml").read_text()
    assert text.startswith("# A ddpkit job")
    check = cli("validate", str(tmp_path / "job.yaml"))
    assert check.returncode == 0 and "ok: my-ddp-job" in check.stdout


def test_init_refuses_to_overwrite(tmp_path):
    (tmp_path / "job.yaml").write_text("mine\n")
    result = cli("init", "job.yaml", cwd=tmp_path)
    assert result.returncode == 2 and "pass --force" in result.stderr
    assert (tmp_path / "job.yaml").read_text() == "mine\n"


def test_validate_prints_the_topology():
    result = cli("validate", "examples/multinode-gpu.yaml")
    assert result.returncode == 0
    assert "2 node(s) x 8 process(es) on 8 GPU(s), world size 16, backend nccl" in result.stdout


def test_set_reaches_the_model():
    result = cli("validate", "examples/quickstart.yaml", "--set", "nodes=3", "--set", "procs_per_node=4",
                    "--set", "checkpoint.ephemeral=true")
    assert "3 node(s) x 4 process(es)" in result.stdout and "world size 12" in result.stdout


def test_bad_set_is_exit_2_naming_the_override():
    result = cli("validate", "examples/quickstart.yaml", "--set", "nodes=zero")
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: --set nodes: nodes: 'zero' is not a node count: "
                                     "write 2, or 2:4 for elastic")


def test_unknown_handle_is_exit_2():
    result = cli("status", "1234")
    assert result.returncode == 2 and "is not a job handle" in result.stderr


def test_write_output_leaves_nothing_half_written(tmp_path):
    from deploy.cli import write_output

    target = tmp_path / "out.yaml"
    target.write_text("old\n")
    write_output("new\n", str(target))
    assert target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.yaml"]


def test_bad_job_writes_no_output_file(tmp_path):
    out = tmp_path / "job.sbatch"
    result = cli("render", "slurm", "tests/bad_input/unknown_slurm.yaml", "-o", str(out))
    assert result.returncode == 2
    assert not out.exists() and list(tmp_path.iterdir()) == []


def _subcommands():
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return sorted(action.choices)


def test_a_command_s_own_parser_is_the_one_the_whole_parser_has():
    """main() makes only the parser of the command it runs (build_parser(only=...))."""
    from deploy.cli import COMMANDS

    def subparser(parser, command):
        return next(a for a in parser._actions if a.dest == "command").choices[command]

    assert tuple(_subcommands()) == tuple(sorted(COMMANDS))
    whole = build_parser()
    for command in COMMANDS:
        alone = subparser(build_parser(only=command), command)
        assert alone.format_help() == subparser(whole, command).format_help()
        assert alone.get_default("func") is subparser(whole, command).get_default("func")


@pytest.mark.parametrize("command", _subcommands())
def test_every_command_has_help_with_an_example(command):
    result = cli(command, "--help")
    assert result.returncode == 0
    assert "example:\n  ddpkit" in result.stdout or "example:\n  sudo ddpkit" in result.stdout


def test_logs_rank_means_a_node_everywhere_and_worker_rank_a_process():
    help_text = " ".join(cli("logs", "--help").stdout.split())
    assert "--rank N node rank N, the same on every target (default 0)" in help_text
    assert "--worker-rank R global rank R" in help_text and "--all every node's lines" in help_text
    for other in (["--worker-rank", "1"], ["--all"]):
        both = cli("logs", "slurm://1", "--rank", "0", *other)
        assert both.returncode == 2 and "not allowed with argument" in both.stderr
    bad = cli("logs", "slurm://1", "--grep", "(")
    assert bad.returncode != 0 and "--grep '(' is not a regular expression" in bad.stderr


@pytest.mark.parametrize("argv", [["validate", "examples/multinode-gpu.yaml"],
                                  ["render", "k8s", "examples/multinode-gpu.yaml"],
                                  ["render", "slurm", "examples/multinode-gpu.yaml"]])
def test_validate_and_render_import_no_heavy_library(argv):
    probe = (
        "import sys, io, contextlib\n"
        "from deploy.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    rc = main({argv!r})\n"
        "heavy = sorted(m for m in ('torch', 'kubernetes', 'submitit') if m in sys.modules)\n"
        "print(rc, heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True)
    assert result.stdout.split() == ["0", "[]"], result.stdout + result.stderr


def test_a_handles_verbs_do_not_build_the_job_model():
    """`status`, `logs`, `why`, `cancel` take a handle, not a job file: the CLI they start in does
    not import the job model (pydantic builds its classes at import), so a poll stays cheap."""
    probe = ("import sys\n"
             "import deploy.cli\n"
             "print(sorted(m for m in ('deploy.spec', 'deploy.load', 'pydantic') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True)
    assert result.stdout.split() == ["[]"], result.stdout + result.stderr


def test_docs_reference_matches_the_model():
    from deploy.docs import REFERENCE, reference

    text = (REPO / REFERENCE).read_text()
    assert reference() in text, f"{REFERENCE}'s job-file reference is stale: run `make docs`"


def test_plot_overlays_several_runs_and_a_missing_run_is_one_line(tmp_path):
    import json

    for name, lr in (("a", 0.1), ("b", 0.01)):
        d = tmp_path / "runs" / name
        d.mkdir(parents=True)
        lines = [{"step": s, "epoch": 0, "loss": 2.3 - lr * s, "lr": lr, "samples_per_s": 1000.0 + s} for s in range(1, 30)]
        lines += [{"eval": True, "step": 29, "epoch": 0, "eval_loss": 2.0},
                  {"summary": True, "world_size": 2, "samples_per_s": 1010.0}]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    result = cli("plot", "runs/a", "runs/b", "-o", "both.png", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "both.png" and (tmp_path / "both.png").stat().st_size > 5000
    one = cli("plot", "runs/a", cwd=tmp_path)
    assert one.returncode == 0 and (tmp_path / "runs" / "a" / "metrics.png").exists()
    missing = cli("plot", "runs/a", "runs/nope", cwd=tmp_path)
    assert missing.returncode == 2 and "runs/nope/metrics.jsonl does not exist" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1 and "Traceback" not in missing.stderr


@pytest.mark.parametrize("before", [None, "logfire"])
def test_the_entry_point_leaves_the_pydantic_plugins_variable_as_it_was(monkeypatch, capsys, before):
    """deploy.__main__.run builds ddpkit's models without pydantic plugins, and then puts the
    variable back: what the CLI starts (and any later model) sees the user's setting."""
    import gc
    import os
    import sys

    from deploy import __main__ as entry

    if before is None:
        monkeypatch.delenv(entry.PLUGINS_OFF, raising=False)
    else:
        monkeypatch.setenv(entry.PLUGINS_OFF, before)
    monkeypatch.setattr(sys, "argv", ["ddpkit", "validate", "examples/quickstart.yaml"])
    try:
        assert entry.run() == 0
    finally:
        gc.unfreeze()  # run() froze this test process's objects, as it does a CLI's
    assert os.environ.get(entry.PLUGINS_OFF) == before and gc.isenabled()
