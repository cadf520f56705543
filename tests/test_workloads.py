"""The workload API and the trainer's handling of standard PyTorch data and models.

Real trainer processes (gloo, several ranks where it matters) run the worked example
(examples/own_workload/tiny_lm.py) and the small workloads in tests/user_workloads.py;
the decisions that need a GPU (device per rank, precision) are tested as functions.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from deploy.load import parse_job
from tests.conftest import REPO, ddpkit
from tests.trainer_util import free_port, launch_env, records, run, summary, wait_for, write_job
from trainer import checkpoint
from trainer.config import ConfigError, TrainConfig
from trainer.data import RankShard, model_loss, split_batch
from trainer.dist import DistEnvError, gpu_index
from trainer.train import autocast_dtype, choose_static_graph, params_sha256, step_optimizer

EXAMPLE = REPO / "examples" / "own-workload.yaml"


def trainer_alone(job: Path, cwd: Path, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    """One trainer process without a launcher (`python -m trainer`)."""
    return subprocess.run([sys.executable, "-m", "trainer"], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO),
                                                "DDPKIT_JOB_FILE": str(job), "OMP_NUM_THREADS": "1", **env})


# -- batches, losses, shards: the pieces ------------------------------------------------------


def test_batches_split_into_inputs_and_target():
    x, y = torch.zeros(2, 3), torch.ones(2)
    assert split_batch((x, y), own_loss=False)[2] is y
    args, kwargs, target = split_batch({"input_ids": x, "attention_mask": x, "labels": y}, own_loss=False)
    assert args == () and sorted(kwargs) == ["attention_mask", "input_ids"] and target is y
    args, kwargs, target = split_batch({"input_ids": x, "labels": y}, own_loss=True)
    assert sorted(kwargs) == ["input_ids", "labels"] and target is y  # labels go to forward too
    with pytest.raises(KeyError, match="the batch has no 'labels'"):
        split_batch({"input_ids": x}, own_loss=False)


def test_a_models_own_loss_is_found_in_its_output():
    class Out:
        loss = torch.tensor(2.0)

    assert model_loss(Out()) == 2.0
    assert model_loss({"loss": torch.tensor(3.0), "logits": torch.zeros(2)}) == 3.0
    assert model_loss((torch.tensor(4.0), torch.zeros(2))) == 4.0
    with pytest.raises(TypeError, match="no loss in its output"):
        model_loss(torch.zeros(2, 2))


def test_an_iterable_is_shared_out_once_over_ranks():
    data = list(range(103))
    shards = [list(RankShard(data, r, 3, seed=0)) for r in range(3)]
    assert sorted(sum(shards, [])) == data and len(shards[0]) == 35 and len(shards[2]) == 34
    assert list(RankShard(data, 1, 3, seed=0, sharded=True)) == data  # already sharded: as it is


def test_model_args_take_any_yaml_value():
    args = {"model": {"hidden": [64, 32], "act": "gelu"}, "dropout": 0.1, "tied": True, "vocab": None}
    job = parse_job({"name": "a", "image": "i", "train": {"model": "pkg.mod:build", "model_args": args}})
    assert job.train.model_args == args
    assert yaml.safe_load(job.to_yaml())["train"]["model_args"] == args


# -- decisions that need a GPU, as functions -----------------------------------------------


@pytest.mark.parametrize("precision, device, bf16, dtype", [
    ("auto", "cuda", True, "bfloat16"),
    ("auto", "cuda", False, "float16"),  # a V100/T4: fp16 with a GradScaler, not bf16
    ("auto", "cpu", False, None),
    ("fp32", "cuda", True, None),
    ("fp16", "cuda", False, "float16"),
    ("bf16", "cpu", False, "bfloat16"),
])
def test_precision_per_device(precision, device, bf16, dtype):
    assert autocast_dtype(precision, device, bf16) == dtype


@pytest.mark.parametrize("precision, device, bf16, message", [
    ("fp16", "cpu", False, "fp16 needs CUDA"),
    ("bf16", "cuda", False, "this GPU has no native bf16"),
])
def test_impossible_precisions_are_config_errors(precision, device, bf16, message):
    with pytest.raises(ConfigError, match=message):
        autocast_dtype(precision, device, bf16)


def test_fewer_visible_gpus_than_ranks_is_an_error_at_start(monkeypatch):
    assert gpu_index(3, 8, 8) == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with pytest.raises(DistEnvError, match=r"8 ranks on this node but 4 GPU\(s\) visible \(CUDA_VISIBLE_DEVICES=0,1,2,3\)"):
        gpu_index(5, 8, 4)


def test_a_step_the_grad_scaler_skips_does_not_advance_the_lr_schedule():
    """fp16: inf gradients make GradScaler skip the optimizer step; the schedule must not move."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    before = params_sha256(model)
    scaler.scale(model(torch.full((1, 2), float("inf"))).sum()).backward()  # inf gradients
    if step_optimizer(opt, scaler):
        sched.step()
    assert params_sha256(model) == before and sched.last_epoch == 0 and opt.param_groups[0]["lr"] == 1.0
    opt.zero_grad()
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    if step_optimizer(opt, scaler):
        sched.step()
    assert params_sha256(model) != before and sched.last_epoch == 1 and opt.param_groups[0]["lr"] == 0.5


# -- real runs --------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_worked_example_trains_with_dict_batches_its_own_loss_and_param_groups(tmp_path):
    """2 ranks: padded dict batches from a collate_fn, a model computing its loss from labels,
    AdamW with two parameter groups, an extra metric, nested model_args, a random_split eval."""
    result = ddpkit("run", str(EXAMPLE), "--local", "--set", "train.plot=false",
                    "--set", "train.log_every_steps=1", cwd=tmp_path,
                    env={"PYTHONPATH": f"{REPO}", "OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "own-workload"
    s = summary(run_dir)
    assert s["status"] == "completed" and s["world_size"] == 2 and s["params_identical"], s
    assert s["final_loss"] < s["first_loss"] and s["eval_token_accuracy"] > 0.3, s
    evals = [r for r in records(run_dir) if r.get("eval")]
    assert len(evals) == 2 and all("eval_token_accuracy" in r and "eval_accuracy" not in r for r in evals)
    assert "token_accuracy" in result.stdout  # the CLI's summary shows extra metrics
    state = checkpoint.load(checkpoint.newest_valid(run_dir / "checkpoints"))
    groups = state["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0] and groups[0]["betas"] == (0.9, 0.99)
    assert (run_dir / "checkpoints" / "FINISHED").exists()


@pytest.mark.slow
def test_an_iterable_dataset_trains_on_two_ranks_with_uneven_shards(tmp_path):
    """163 samples over 2 ranks (82 and 81), batch 8, accumulation 2: each epoch ends on both
    ranks when the shorter shard does (no rank waits in a collective); eval is iterable too."""
    job = write_job(tmp_path, "iter", {"model": "tests.user_workloads:iterable", "model_args": {"samples": 203},
                                       "batch_size": 8, "grad_accum": 2, "epochs": 3, "max_steps": 100,
                                       "eval_every_epochs": 1, "lr": 0.2})
    result = run(job, tmp_path, nproc=2)
    assert result.returncode == 0, result.stdout[-3000:]
    s = summary(tmp_path / "runs" / "iter")
    # 81 samples -> 11 batches (the 11th short) -> 5 steps per epoch, the odd micro-batch dropped
    assert s["steps"] == 15 and s["epochs_done"] == 3 and s["params_identical"], s
    assert s["final_loss"] < s["first_loss"]
    # all 40 held-out samples counted once over the two ranks' shares: accuracy is k/40
    assert s["eval_accuracy"] * 40 == pytest.approx(round(s["eval_accuracy"] * 40))


@pytest.mark.slow
def test_an_iterable_dataset_resumes_only_on_the_ranks_that_wrote_its_checkpoint(tmp_path):
    """Each rank reads its own share of an IterableDataset, so its position is per rank: a
    checkpoint of 2 ranks is refused on 1 with one line that says why, and nothing trains."""
    job = write_job(tmp_path, "iterstop", {"model": "tests.user_workloads:iterable", "batch_size": 8,
                                           "max_steps": 40, "epochs": 5}, {"every_steps": 2})
    first = run(job, tmp_path, nproc=2, DDPKIT_STOP_AT_STEP="3")
    assert first.returncode == 143, first.stdout[-3000:]
    one = run(job, tmp_path, nproc=1)
    assert one.returncode != 0, one.stdout[-3000:]
    [why] = [line for line in one.stdout.splitlines() if line.startswith("ddpkit: checkpoint ")]
    assert "was written by 2 ranks, this run has 1: the data position of an IterableDataset is per rank" in why
    assert "run with 2 ranks (nodes x processes per node)" in why


@pytest.mark.slow
def test_an_iterable_without_max_steps_is_a_config_error(tmp_path):
    job = write_job(tmp_path, "iterbad", {"model": "tests.user_workloads:iterable"})
    result = trainer_alone(job, tmp_path)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "ddpkit: train.max_steps: an IterableDataset has no length, so the schedule needs a step "
        "count; set train.max_steps"]


@pytest.mark.slow
def test_batchnorm_parameters_are_identical_and_broadcast_buffers_reaches_ddp(tmp_path):
    """Rank-local BatchNorm statistics are not "parameters DIFFER"; broadcast_buffers=False
    lets each rank keep its own buffer (rank 1 bumps by 2 per step: 8 steps -> 8 and 16)."""
    job = write_job(tmp_path, "bn", {"model": "tests.user_workloads:batchnorm", "batch_size": 32,
                                     "eval_every_epochs": 1, "broadcast_buffers": False, "static_graph": True})
    result = run(job, tmp_path, nproc=2)
    assert result.returncode == 0, result.stdout[-3000:]
    s = summary(tmp_path / "runs" / "bn")
    assert s["steps"] == 8 and s["params_identical"] is True, s
    assert s["buffers_identical"] is None  # BatchNorm running statistics: rank-local, not compared
    assert len({r["buffers_sha256"] for r in s["ranks"]}) == 2
    assert s["eval_bumps"] == pytest.approx((8 + 16) / 2)  # broadcast on: (8 + 9) / 2
    assert "broadcast_buffers False, static_graph True" in result.stdout


@pytest.mark.slow
def test_sync_batchnorm_on_cpu_is_one_line_exit_2(tmp_path):
    job = write_job(tmp_path, "sbn", {"model": "tests.user_workloads:batchnorm", "sync_batchnorm": True})
    result = trainer_alone(job, tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "ddpkit: train.sync_batchnorm: torch's SyncBatchNorm runs on GPUs only; remove it on CPU "
        "(BatchNorm statistics are then rank-local)"]


@pytest.mark.slow
def test_an_error_in_the_loss_is_a_failure_with_its_traceback_in_torchruns_summary(tmp_path):
    job = write_job(tmp_path, "badloss", {"model": "tests.user_workloads:bad_loss", "max_steps": 2})
    result = run(job, tmp_path, nproc=1)
    assert result.returncode == 1, result.stdout[-3000:]
    assert "Traceback (most recent call last)" in result.stdout
    # @record wrote torchrun's error file: its failure summary names the error
    root_cause = result.stdout.split("Root Cause", 1)[1]
    assert "ValueError: loss got logits (64, 2) and targets (64,): shapes do not match" in root_cause
    assert "To enable traceback" not in result.stdout


@pytest.mark.slow
def test_a_failing_evaluation_leaves_no_finished_marker(tmp_path):
    job = write_job(tmp_path, "badeval", {"model": "tests.user_workloads:failing_eval", "batch_size": 32,
                                          "eval_every_epochs": 1}, checkpoint={"every_steps": 3})
    result = trainer_alone(job, tmp_path)
    assert result.returncode == 1 and "RuntimeError: the evaluation metric failed" in result.stderr
    ckpts = tmp_path / "runs" / "badeval" / "checkpoints"
    assert not (ckpts / "FINISHED").exists()  # a rerun evaluates again instead of doing nothing
    assert checkpoint.checkpoints(ckpts)[0][0] == 8  # the last step was saved before evaluating


@pytest.mark.slow
def test_resume_is_exact_with_random_augmentation_in_dataloader_workers(tmp_path):
    """2 workers drawing random noise per sample: stopped at step 5 and resumed, the run ends
    with exactly the parameters of an uninterrupted one."""
    train = {"model": "tests.user_workloads:augmented", "batch_size": 16, "num_workers": 2, "epochs": 2}
    whole = write_job(tmp_path, "whole", train)
    parts = write_job(tmp_path, "parts", train, checkpoint={"every_steps": 1000})
    assert trainer_alone(whole, tmp_path).returncode == 0
    first = trainer_alone(parts, tmp_path, DDPKIT_STOP_AT_STEP="5")
    assert first.returncode == 143, first.stderr[-2000:]
    assert summary(tmp_path / "runs" / "parts")["steps"] == 5
    second = trainer_alone(parts, tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    a, b = summary(tmp_path / "runs" / "whole"), summary(tmp_path / "runs" / "parts")
    assert b["resumed_from_step"] == 5 and a["steps"] == b["steps"] == 48
    assert a["final_params_sha256"] == b["final_params_sha256"]


@pytest.mark.slow
def test_sigterm_while_joining_the_process_group_exits_137_at_once(tmp_path):
    """Rank 0 of 2 waits in init_process_group for a rank that never comes (C++, where Python
    signal handlers do not run); SIGTERM still ends it long before train.timeout_s, with 137
    (retryable; not 143, which promises a checkpoint of that moment)."""
    job = write_job(tmp_path, "lonely", {"timeout_s": 120})
    proc = subprocess.Popen([sys.executable, "-m", "trainer"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "DDPKIT_JOB_FILE": str(job),
                                 "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    out: list[str] = []
    try:
        wait_for(lambda: "joining the process group" in (out.append(proc.stdout.readline()) or "".join(out)),
                 180, "the trainer to join its process group")
        time.sleep(1.0)
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 137, "".join(out) + rest
        assert time.monotonic() - t < 30
        assert "stop signal before training started" in rest
    finally:
        proc.kill()


def test_train_config_defaults_keep_ddp_as_it_was_but_static_graph_is_auto():
    cfg = TrainConfig()
    assert (cfg.broadcast_buffers, cfg.static_graph, cfg.sync_batchnorm) == (True, "auto", False)


# -- DDP's static_graph: auto, true, false ----------------------------------------------------


@pytest.mark.parametrize("value", [True, False, "auto"])
def test_static_graph_takes_auto_or_a_yaml_bool(value):
    assert TrainConfig.model_validate(yaml.safe_load(f"static_graph: {str(value).lower()}")).static_graph == value


def test_static_graph_refuses_anything_else():
    with pytest.raises(ValueError, match="static_graph"):
        TrainConfig(static_graph="sometimes")


@pytest.mark.parametrize(("train", "declared", "accum", "on", "why"), [
    ({}, True, 1, True, "auto: the workload 'cnn' uses every parameter, the same way, every step"),
    ({}, False, 1, False, "does not declare Workload(static_graph=True)"),
    ({"find_unused_parameters": True}, True, 1, False, "find_unused_parameters is true"),
    ({}, True, 2, False, "2 micro-batches a step (torch's static_graph fails under no_sync)"),
    ({"compile": True}, True, 1, False, "train.compile is true"),
    ({"static_graph": True}, False, 1, True, "train.static_graph: true"),
    ({"static_graph": True, "find_unused_parameters": True}, False, 1, True, "train.static_graph: true"),
    ({"static_graph": False}, True, 1, False, "train.static_graph: false"),
    ({"static_graph": False}, True, 4, False, "train.static_graph: false"),
])
def test_auto_turns_static_graph_on_only_where_it_is_safe_and_says_why(train, declared, accum, on, why):
    chosen, said = choose_static_graph(TrainConfig(**train), declared, accum)
    assert chosen is on and why in said


def test_static_graph_forced_with_accumulation_is_refused_in_one_line():
    """torch 2.13: DDP(static_graph=True) fails an INTERNAL ASSERT when the first backward runs
    under no_sync (pytorch/pytorch#143580), so the trainer refuses it before the first step."""
    cfg = TrainConfig(static_graph=True, grad_accum=2)
    with pytest.raises(ConfigError, match=r"^train\.static_graph: true fails with 2 micro-batches .* set "
                       r"train\.static_graph: auto or false$"):
        choose_static_graph(cfg, True, 2)


def test_the_built_in_workloads_declare_a_static_graph():
    from trainer.models import build_workload

    for model, args in (("cnn", {}), ("gpt", {"d_model": 16, "layers": 1, "heads": 2, "seq_len": 8, "samples": 16})):
        assert build_workload(TrainConfig(model=model, model_args=args, data_samples=16)).static_graph, model


@pytest.mark.slow
@pytest.mark.parametrize(("case", "train", "fix"), [
    ("forced", {"static_graph": True}, "set train.static_graph: false"),
    ("declared", {"model_args": {"declare": True}},
     "remove static_graph=True from the Workload of 'tests.user_workloads:changing', or set train.static_graph: false"),
])
def test_a_graph_that_changes_under_static_graph_ends_the_run_with_one_line_naming_the_fix(tmp_path, case, train, fix):
    """The model drops a layer after 2 steps. torch notices in the next step (RuntimeError on
    every rank, after one step whose gradients were not all-reduced); the run ends there."""
    job = write_job(tmp_path, case, {"model": "tests.user_workloads:changing", "max_steps": 6, "batch_size": 16,
                                     **train, "model_args": {"extra_steps": 2, **train.get("model_args", {})}})
    result = run(job, tmp_path, nproc=2)
    assert result.returncode == 1, result.stdout[-3000:]  # torchrun's, for workers that exited 2
    lines = [line for line in result.stdout.splitlines() if line.startswith("ddpkit: train.static_graph:")]
    assert len(lines) == 2 and all(line.endswith(fix) for line in lines), result.stdout[-3000:]
    assert ("changed between steps, noticed in step 4 (torch: Expected to have finished reduction in the prior "
            "iteration before starting a new one.)") in lines[0], lines[0]


@pytest.mark.slow
def test_auto_leaves_static_graph_off_for_an_undeclared_workload_and_says_so(tmp_path):
    """The same changing model, not declared static, with find_unused_parameters (what torch
    asks for it): auto stays off, the log says why, and it trains to the end."""
    job = write_job(tmp_path, "undeclared", {"model": "tests.user_workloads:changing", "max_steps": 6,
                                             "batch_size": 16, "find_unused_parameters": True})
    result = run(job, tmp_path, nproc=2)
    assert result.returncode == 0, result.stdout[-3000:]
    assert ("static_graph False (auto: train.find_unused_parameters is true (the parameters used may change "
            "between steps))") in result.stdout
    assert summary(tmp_path / "runs" / "undeclared")["params_identical"]


def test_launch_env_helper_is_untouched():  # guards the helper other tests rely on
    assert launch_env(Path("x.yaml"))["OMP_NUM_THREADS"] == "1"
