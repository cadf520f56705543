"""One test per validation rule of the job model, each asserting the message a user sees."""

from __future__ import annotations

import copy

import pytest
import yaml
from conftest import EXAMPLES, REPO
from hypothesis import given
from hypothesis import strategies as st

from deploy import units
from deploy.errors import UserError
from deploy.load import load_job, parse_job
from deploy.spec import JobSpec
from deploy.yamlfile import load_scalar

BASE = {"name": "demo", "image": "ddpkit:0.1"}


def problems(patch: dict, overrides=()) -> str:
    data = copy.deepcopy(BASE)
    data.update(copy.deepcopy(patch))
    with pytest.raises(UserError) as info:
        parse_job(data, overrides=list(overrides))
    return "\n".join(info.value.problems)


def ok(patch: dict, overrides=()) -> JobSpec:
    data = {**copy.deepcopy(BASE), **copy.deepcopy(patch)}
    return parse_job(data, overrides=list(overrides))


RULES = [
    # (rule, patch, expected message fragment)
    ("unknown key gets a did-you-mean hint", {"gpus_per_nod": 1}, "gpus_per_nod: unknown field, did you mean 'gpus_per_node'?"),
    ("unknown key without a close match lists valid keys", {"slurm": {"zzz": 1}}, "slurm.zzz: unknown field; valid: account,"),
    ("name is a DNS-1035 label", {"name": "9lives"}, "is not a DNS-1035 label"),
    ("name leaves room for target suffixes", {"name": "a" * 41}, "41 characters; at most 40"),
    ("image is an image reference", {"image": "my image"}, "is not an image reference"),
    ("nodes parses N or MIN:MAX", {"nodes": "2-4"}, "is not a node count: write 2, or 2:4 for elastic"),
    ("elastic range is ordered", {"nodes": "4:2"}, "has min > max; write 2:4"),
    ("at least one node", {"nodes": 0}, "nodes: at least 1 node"),
    ("gpus per node in range", {"gpus_per_node": 65}, "gpus_per_node: must be less than or equal to 64"),
    ("gpu resource is an extended resource name", {"gpu_resource": "gpu"}, "is not an extended resource name"),
    ("one process per GPU", {"gpus_per_node": 8, "procs_per_node": 4}, "procs_per_node: 4 must equal gpus_per_node (8)"),
    ("memory is a Kubernetes quantity", {"resources": {"memory": "12 GB"}}, "is not a Kubernetes quantity: write e.g. 32Gi"),
    ("shm fits in memory", {"resources": {"memory": "1Gi", "shm": "2Gi"}}, "resources.shm: 2Gi exceeds memory (1Gi)"),
    ("time limit is a duration", {"time_limit": "1 day"}, "time_limit: '1 day' is not a duration"),
    ("env names are valid", {"env": {"1BAD": "x"}}, "'1BAD' is not a valid variable name"),
    ("env may not set RANK", {"env": {"RANK": "0"}}, "RANK is set by ddpkit, not the job file: torchrun sets"),
    ("env may not set MASTER_ADDR", {"env": {"MASTER_ADDR": "x"}}, "MASTER_ADDR is set by ddpkit"),
    ("env may not set PET_*", {"env": {"PET_NNODES": "2"}}, "the Kubeflow operators set PET_*"),
    ("env may not set SLURM_*", {"env": {"SLURM_NTASKS": "2"}}, "Slurm sets SLURM_*"),
    ("env booleans must be quoted", {"env": {"FLAG": True}}, "env.FLAG: ambiguous YAML value"),
    ("secret env names are valid", {"secret_env": [{"name": "WORLD_SIZE", "secret": "s", "key": "k"}]}, "WORLD_SIZE is set by ddpkit"),
    ("secret names are DNS names", {"secret_env": [{"name": "A", "secret": "My_Secret", "key": "k"}]}, "is not a valid Secret name"),
    ("secret env does not repeat env", {"env": {"A": "1"}, "secret_env": [{"name": "A", "secret": "s", "key": "k"}]}, "secret_env.0.name: A is set twice"),
    ("a volume has exactly one source", {"volumes": [{"name": "d", "mount": "/d", "claim": "c", "host_path": "/x"}]}, "set exactly one of claim, host_path, nfs, empty_dir, secret, config_map (got claim, host_path)"),
    ("a volume has a source", {"volumes": [{"name": "d", "mount": "/d"}]}, "(got none)"),
    ("mount paths are absolute", {"volumes": [{"name": "d", "mount": "d", "claim": "c"}]}, "must be an absolute path"),
    ("/dev/shm is reserved", {"volumes": [{"name": "d", "mount": "/dev/shm", "empty_dir": {}}]}, "mount /dev/shm is reserved: set resources.shm instead"),
    ("volume names are unique", {"volumes": [{"name": "d", "mount": "/a", "claim": "c"}, {"name": "d", "mount": "/b", "claim": "c"}]}, "volumes.1.name: d is used twice"),
    ("mount paths are unique", {"volumes": [{"name": "a", "mount": "/d", "claim": "c"}, {"name": "b", "mount": "/d/", "claim": "c"}]}, "volumes.1.mount: /d is used twice"),
    ("volume names are DNS labels", {"volumes": [{"name": "Data", "mount": "/d", "claim": "c"}]}, "is not a valid volume name"),
    ("tolerations: Exists takes no value", {"k8s": {"tolerations": [{"key": "a", "operator": "Exists", "value": "b"}]}}, "k8s.tolerations.0.operator: Invalid value: \"b\": value must be empty when `operator` is 'Exists'"),
    ("flavor is one of four", {"k8s": {"flavor": "mpijob"}}, "k8s.flavor: must be one of 'pytorchjob', 'trainjob', 'jobset' or 'job'"),
    ("namespace is a DNS label", {"k8s": {"namespace": "ML"}}, "is not a valid namespace"),
    ("labels are valid", {"k8s": {"labels": {"team": "a b"}}}, "is not a valid label value"),
    ("annotation keys are valid", {"k8s": {"annotations": {"bad key": "x"}}}, "is not a valid annotation key"),
    ("queue is a Kubernetes name", {"k8s": {"queue": "Team Queue"}}, "is not a valid Kubernetes name"),
    ("slurm words carry no shell", {"slurm": {"partition": "gpu; rm -rf /"}}, "letters, digits and _.,:@%+=/|&- only"),
    ("container mounts are SRC[:DST]", {"slurm": {"container_mounts": ["a:/b"]}}, "is not SRC[:DST[:ro|rw]]"),
    ("modules are module names", {"slurm": {"modules": ["cuda 12"]}}, "is not a module name"),
    ("setup lines are single lines", {"slurm": {"setup": ["a\nb"]}}, "one non-empty line per entry"),
    ("extra directives are sbatch options", {"slurm": {"extra_directives": ["--mail-user=$(id)"]}}, "is not an sbatch option"),
    ("extra directives do not repeat derived ones", {"slurm": {"extra_directives": ["--time=10"]}}, "ddpkit derives --time; set time_limit instead"),
    ("NCCL owns SIGUSR1", {"slurm": {"signal": "SIGUSR1"}}, "NCCL uses SIGUSR1 itself"),
    ("requeue needs restarts", {"slurm": {"requeue": True}}, "slurm.requeue: needs restarts >= 1"),
    ("restarts in range", {"restarts": 101}, "restarts: must be less than or equal to 100"),
    ("train section is checked by the trainer's model", {"train": {"batch_size": 0}}, "train.batch_size: must be greater than or equal to 1"),
    ("command is a non-empty argv", {"command": []}, "give the program and its arguments as a non-empty list"),
    ("name is required", {"name": None}, "name: expected a valid string"),
]


@pytest.mark.parametrize("rule,patch,expected", RULES, ids=[r[0] for r in RULES])
def test_validation_rule(rule, patch, expected):
    assert expected in problems(patch)


def test_missing_required_fields():
    with pytest.raises(UserError) as info:
        parse_job({})
    assert info.value.problems == ["job.yaml: name: required field is missing",
                                   "job.yaml: image: required field is missing"]


def test_errors_carry_file_and_line(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("name: demo\nimage: ddpkit:0.1\nk8s:\n  namespace: ml\n  flavr: job\n")
    with pytest.raises(UserError) as info:
        load_job(str(path))
    assert info.value.problems == [f"{path}:5: k8s.flavr: unknown field, did you mean 'flavor'?"]


def test_set_overrides_are_yaml_typed():
    job = ok({}, ["nodes=4", "train.lr=0.5", "k8s.flavor=job", "resources.cpus_per_node=8",
                  "slurm.exclusive=true", "env.NCCL_DEBUG=INFO"])
    assert job.nodes.min == 4 and job.train.lr == 0.5 and job.k8s.flavor == "job"
    assert job.resources.cpus_per_node == 8 and job.slurm.exclusive is True
    assert job.env == {"NCCL_DEBUG": "INFO"}


def test_set_indexes_into_lists():
    job = ok({"volumes": [{"name": "d", "mount": "/d", "claim": "c"}]}, ["volumes.0.read_only=true"])
    assert job.volumes[0].read_only is True


def test_set_errors_name_the_override():
    assert "--set nodes: nodes: at least 1 node" in problems({}, ["nodes=0"])
    assert "--set slurm.partion: slurm.partion: unknown field" in problems({}, ["slurm.partion=gpu"])
    assert "expected KEY=VALUE" in problems({}, ["nodes"])
    assert "is not an index into it" in problems({"volumes": []}, ["volumes.3.mount=/x"])


def test_elastic_nodes_round_trip():
    job = ok({"nodes": "2:4"})
    assert job.nodes.elastic and (job.nodes.min, job.nodes.max) == (2, 4)
    assert yaml.safe_load(job.to_yaml())["nodes"] == "2:4"
    assert yaml.safe_load(ok({"nodes": 3}).to_yaml())["nodes"] == 3


def test_topology_is_derived_once():
    gpu = ok({"nodes": 2, "gpus_per_node": 8})
    assert (gpu.nproc_per_node, gpu.world_size, gpu.backend) == (8, 16, "nccl")
    cpu = ok({"nodes": 2, "procs_per_node": 2})
    assert (cpu.nproc_per_node, cpu.world_size, cpu.backend) == (2, 4, "gloo")
    assert ok({}).nproc_per_node == 1


@pytest.mark.parametrize("written,read_as", [("1.10", 1.1), ("0x10", 16), ("010", 8), ("4", 4)])
def test_env_values_are_strings_exactly_as_written(tmp_path, written, read_as):
    """YAML changes unquoted numbers (1.10 -> 1.1): refused with the fix; quoted, kept as is."""
    path = tmp_path / "job.yaml"
    path.write_text(f"name: demo\nimage: i:1\nenv:\n  V: {written}\n")
    with pytest.raises(UserError) as err:
        load_job(str(path))
    assert err.value.problems == [
        f"{path}:4: env.V: YAML read this as the number {read_as!r}, which may not be what you "
        f"wrote (1.10 reads as 1.1, 0x10 as 16, 010 as 8); quote it, e.g. \"{read_as}\""]
    path.write_text(f"name: demo\nimage: i:1\nenv:\n  V: '{written}'\n")
    assert load_job(str(path)).env == {"V": written}
    # --set env.NAME=VALUE takes VALUE as written
    assert load_job(str(path), [f"env.W={written}", "env.T=true"]).env == {
        "V": written, "W": written, "T": "true"}


@pytest.mark.parametrize("field,value", [
    ("gpus_per_node", "yes"), ("gpus_per_node", "'2'"), ("restarts", "true"), ("nodes", "2.5"),
    ("procs_per_node", "2.0"), ("train.epochs", "yes"), ("checkpoint.every_steps", "'10'"),
    ("train.batch_size", "1.5")])
def test_counts_are_integers_not_booleans_or_strings(tmp_path, field, value):
    path = tmp_path / "job.yaml"
    path.write_text("name: demo\nimage: i:1\n")
    with pytest.raises(UserError) as err:
        load_job(str(path), [f"{field}={value}"])
    [problem] = err.value.problems
    assert problem.startswith(f"--set {field}: {field}: "), problem
    assert "whole number" in problem and "Input should" not in problem, problem


def test_cross_field_and_override_errors_point_at_their_own_line(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("name: demo\nimage: i:1\nenv:\n  A: x\nvolumes:\n"
                    "  - {name: a, mount: /d, claim: c}\n  - {name: a, mount: /e, claim: c}\n"
                    "gpus_per_node: 2\nprocs_per_node: 4\n")
    with pytest.raises(UserError) as err:
        load_job(str(path))
    assert err.value.problems == [
        f"{path}:9: procs_per_node: 4 must equal gpus_per_node (2): one process per GPU; remove procs_per_node",
        f"{path}:7: volumes.1.name: a is used twice; give each volume its own name"]
    with pytest.raises(UserError) as err:
        load_job(str(path), ["env.RANK=3", "procs_per_node=2", "volumes.1.name=b"])
    assert err.value.problems == [
        "--set env.RANK: env.RANK: RANK is set by ddpkit, not the job file: torchrun sets the "
        "global rank of each process"]


def test_an_unknown_workload_is_found_by_validate(tmp_path):
    with pytest.raises(UserError) as err:
        parse_job({**BASE, "train": {"model": "resnet50"}})
    assert "train.model: 'resnet50' is neither a built-in workload (cnn, gpt)" in err.value.problems[0]
    assert ok({"train": {"model": "mypkg.models:build"}}).train.model == "mypkg.models:build"


def test_the_builtin_workload_list_is_the_trainer_s():
    from trainer.config import BUILTIN_MODELS
    from trainer.models import BUILTIN

    assert tuple(BUILTIN) == BUILTIN_MODELS


@pytest.mark.parametrize("path", EXAMPLES + [REPO / "deploy" / "starter.yaml"], ids=lambda p: p.name)
def test_examples_validate_and_round_trip(path):
    job = load_job(str(path))
    again = parse_job(yaml.safe_load(job.to_yaml()))
    assert again == job


@pytest.mark.parametrize("text,expected", [("90m", 5400), ("24h", 86400), ("2d", 172800),
                                           ("1h30m", 5400), ("45s", 45), (600, 600), ("600", 600)])
def test_durations(text, expected):
    assert units.parse_duration(text) == expected


@pytest.mark.parametrize("bad", ["", "1x", "h", "-5m", "5 m", 0, True])
def test_bad_durations(bad):
    with pytest.raises(ValueError):
        units.parse_duration(bad)


# time_limit has one meaning on every target: units, or sbatch(1) --time's forms that name hours
@pytest.mark.parametrize("text,seconds", [
    ("90m", 5400), ("2h", 7200), ("1d12h", 129600), ("04:00:00", 14400), ("100:00:00", 360000),
    ("2-12", 216000), ("1-00:30", 88200), ("1-12:00:00", 129600), ("0-00:00:30", 30)])
def test_time_limit_takes_units_and_sbatch_hour_forms_and_reads_back_the_same(text, seconds):
    job = parse_job({"name": "d", "image": "i:1", "time_limit": text})
    assert job.time_limit == seconds
    assert parse_job(yaml.safe_load(job.to_yaml())).time_limit == seconds
    # as an unquoted YAML scalar too (the job file's loader keeps 04:00:00 a string)
    assert parse_job({"name": "d", "image": "i:1", "time_limit": load_scalar(text)}).time_limit == seconds


@pytest.mark.parametrize("value,message", [
    (90, "90 is a bare number: sbatch reads it as minutes, Kubernetes as seconds; write the unit, e.g. 90m"),
    ("3600", "3600 is a bare number"), (1.5, "1.5 is a bare number"),
    ("1:30", "'1:30' is sbatch's minutes:seconds, easily read as hours:minutes; write 1m30s, or HH:MM:SS"),
    ("0:75:00", "minutes and seconds go up to 59"), ("0:00:00", "must be positive"),
    ("1 day", "'1 day' is not a duration")])
def test_time_limit_refuses_what_targets_read_differently(value, message):
    with pytest.raises(UserError) as err:
        parse_job({"name": "d", "image": "i:1", "time_limit": value})
    [line] = err.value.problems
    assert line.startswith("job.yaml: time_limit: ") and message in line, line


@given(st.integers(min_value=1, max_value=10**8))
def test_duration_format_round_trips(seconds):
    assert units.parse_duration(units.format_duration(seconds)) == seconds


@pytest.mark.parametrize("text,expected", [("1Gi", 2**30), ("512Mi", 512 * 2**20), ("8G", 8 * 10**9),
                                           ("1.5Gi", 3 * 2**29), (1024, 1024)])
def test_quantities(text, expected):
    assert units.parse_quantity(text) == expected


def test_slurm_time_rounds_up_to_minutes():
    assert units.slurm_time(90) == "0-00:02:00"
    assert units.slurm_time(86400 + 3600) == "1-01:00:00"


def test_unquoted_elastic_range_is_not_a_base_60_number(tmp_path):
    # YAML 1.1 reads 2:4 as 2*60+4 = 124; a job file means an elastic range
    path = tmp_path / "job.yaml"
    path.write_text("name: demo\nimage: ddpkit:0.1\nnodes: 2:4\n")
    assert (load_job(str(path)).nodes.min, load_job(str(path)).nodes.max) == (2, 4)
    job = ok({}, ["nodes=2:4"])
    assert (job.nodes.min, job.nodes.max) == (2, 4)
