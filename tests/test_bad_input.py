"""The bad-input corpus: every file gets exit 2, a clear one-line error, no traceback, fast,
and in bounded memory (the child runs under a 1 GiB address-space limit, so an alias bomb or a
huge file that were expanded would crash it instead of exiting 2)."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

CORPUS = Path(__file__).parent / "bad_input"

EXPECTED = {
    "malformed.yaml": "invalid YAML: did not find expected ',' or ']' (while parsing a flow sequence at line 2)",
    "wrong_types.yaml": "name: expected a valid string",
    "unknown_top.yaml": "node: unknown field, did you mean 'nodes'?",
    "unknown_k8s.yaml": "k8s.namespce: unknown field, did you mean 'namespace'?",
    "unknown_slurm.yaml": "slurm.partion: unknown field, did you mean 'partition'?",
    "unknown_train.yaml": "train.batchsize: unknown field, did you mean 'batch_size'?",
    "unknown_checkpoint.yaml": "checkpoint.every: unknown field",
    "unknown_resources.yaml": "resources.memroy: unknown field, did you mean 'memory'?",
    "unknown_volume.yaml": "volumes.0.readonly: unknown field, did you mean 'read_only'?",
    "unknown_nfs.yaml": "volumes.0.nfs.opts: unknown field",
    "unknown_toleration.yaml": "k8s.tolerations.0.efect: unknown field, did you mean 'effect'?",
    "unknown_secret_env.yaml": "secret_env.0.value: unknown field",
    "negative.yaml": "nodes: at least 1 node",
    "absurd.yaml": "nodes.min: must be less than or equal to 10000",
    "non_utf8.yaml": "not UTF-8 text",
    "empty.yaml": "the file is empty",
    "comment_only.yaml": "the file is empty",
    "alias_bomb.yaml": "YAML aliases expand to more than",
    "list_not_mapping.yaml": "a job file is a YAML mapping",
    "two_documents.yaml": "holds several YAML documents",
    "duplicate_key.yaml": ":3: name: duplicate key",
    "gpu_job_on_cpu.yaml": ":4: train.device: is cpu but gpus_per_node is 8: the job would hold its GPUs and train on CPU",
    "cuda_without_gpus.yaml": ":3: train.device: is cuda but gpus_per_node is 0",
    "local_rank_arg_form.yaml": ":4: local_rank_arg: 'local_rank': give the option your script reads, as `--local_rank`",
    "local_rank_arg_without_script.yaml": ":3: local_rank_arg: passes the local rank to your script or module",
    "mig_slices.yaml": ":3: gpus_per_node: 2 slices of nvidia.com/mig-3g.40gb: a CUDA process sees only one MIG device",
    "nvidia_visible_devices.yaml": ":4: env.NVIDIA_VISIBLE_DEVICES: overrides the GPUs that the device plugin",
}


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


def validate_bounded(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deploy", "validate", str(path)], cwd=REPO, capture_output=True,
        text=True, timeout=10, preexec_fn=_limit_memory, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def assert_clean_rejection(result: subprocess.CompletedProcess, expected: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    assert expected in result.stderr, result.stderr
    for line in result.stderr.splitlines():
        assert line.startswith("error: "), line


def test_corpus_is_complete():
    assert sorted(p.name for p in CORPUS.iterdir()) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_job_file_is_rejected_with_a_clear_line(name):
    assert_clean_rejection(validate_bounded(CORPUS / name), EXPECTED[name])


def test_twenty_megabyte_file_is_refused_without_reading_it(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("name: ok\nimage: ddpkit:0.1\nenv:\n" + "  K: " + "x" * (20 << 20) + "\n")
    assert_clean_rejection(validate_bounded(big), "a job file is at most 1 MiB")


def test_directory_instead_of_file(tmp_path):
    assert_clean_rejection(validate_bounded(tmp_path), "is a directory")


def test_missing_file_points_to_init(tmp_path):
    assert_clean_rejection(validate_bounded(tmp_path / "nope.yaml"), "ddpkit init")


def test_every_problem_is_reported_at_once():
    result = validate_bounded(CORPUS / "negative.yaml")
    assert_clean_rejection(result, "restarts: must be greater than or equal to 0")
    assert "gpus_per_node" in result.stderr and "nodes" in result.stderr
