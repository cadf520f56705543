"""The trainer: worker env contract, checkpoints, and real 2-rank gloo runs."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys

import pytest

from tests.trainer_util import (
    REPO,
    free_port,
    records,
    run,
    start,
    step_losses,
    stop_after_steps,
    summary,
    write_job,
)
from trainer import checkpoint
from trainer.dist import DistEnv, DistEnvError, read_dist_env
from trainer.train import lr_factor

# -- the worker env contract -------------------------------------------------------------


def test_no_worker_variables_means_one_process():
    assert read_dist_env({}) == DistEnv()
    assert not read_dist_env({}).distributed


def test_torchrun_variables_are_read():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert read_dist_env(env) == DistEnv(3, 4, 1, 2, "node0", 29500)


@pytest.mark.parametrize("env, message", [
    ({"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK=4 is not in [0, WORLD_SIZE=4)"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "MASTER_ADDR is not set but WORLD_SIZE=2"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "99999"}, "MASTER_PORT='99999'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "a",
      "MASTER_PORT": "1"}, "LOCAL_RANK=2"),
])
def test_inconsistent_worker_variables_are_a_clear_error(env, message):
    with pytest.raises(DistEnvError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        read_dist_env(env)


def test_lr_schedules():
    assert [lr_factor(s, 10, 2, "constant") for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor(2, 10, 2, "cosine") == 1.0 and lr_factor(10, 10, 2, "cosine") == pytest.approx(0.0)
    assert lr_factor(6, 10, 2, "linear") == pytest.approx(0.5)
    assert lr_factor(6, 10, 2, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


# -- checkpoints -------------------------------------------------------------------------


def test_checkpoints_keep_the_newest_n(tmp_path):
    for step in (5, 10, 15, 20):
        checkpoint.save(tmp_path, step, {"step": step}, keep=2)
    assert [s for s, _ in checkpoint.checkpoints(tmp_path)] == [20, 15]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000015.pt", "ckpt-000000015.pt.sha256", "ckpt-000000020.pt", "ckpt-000000020.pt.sha256"]
    assert checkpoint.load(checkpoint.newest_valid(tmp_path))["step"] == 20


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "lose the checksum"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog, damage):
    import torch

    checkpoint.save(tmp_path, 10, {"w": torch.arange(1000.0)}, keep=3)
    newest = checkpoint.save(tmp_path, 20, {"w": torch.arange(1000.0) * 2}, keep=3)
    data = bytearray(newest.read_bytes())
    if damage == "flip a byte":
        data[len(data) // 2] ^= 0xFF  # torch.load alone would not notice this one
        newest.write_bytes(bytes(data))
    elif damage == "truncate":
        newest.write_bytes(bytes(data[: len(data) // 3]))
    else:
        newest.with_name(newest.name + ".sha256").unlink()
    with caplog.at_level(logging.WARNING, logger="ddpkit.trainer"):
        chosen = checkpoint.newest_valid(tmp_path)
    assert chosen.name == "ckpt-000000010.pt"
    assert "ckpt-000000020.pt (step 20) is unusable" in caplog.text


def test_no_temporary_files_are_left_behind(tmp_path):
    checkpoint.save(tmp_path, 1, {"a": 1}, keep=1)
    checkpoint.write_finished(tmp_path, 1)
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]
    assert checkpoint.finished_step(tmp_path) == 1


# -- global batches: the data position at any world size ----------------------------------------


@pytest.mark.parametrize(("n", "world", "batch"), [(512, 2, 16), (1000, 4, 8), (96, 3, 32)])
def test_one_micro_batch_a_step_is_distributed_samplers_split(n, world, batch):
    """With grad_accum 1 each rank's batches are those of torch's DistributedSampler (seed +
    epoch, every world-th sample from rank r), epoch after epoch: the textbook loop's data."""
    from torch.utils.data import DistributedSampler

    from trainer.data import GlobalBatches

    for rank in range(world):
        ours = GlobalBatches(n, 7, rank, world, batch, 1)
        theirs = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=7)
        for epoch in (0, 3):
            ours.start(epoch)
            theirs.set_epoch(epoch)
            want = list(theirs)
            want = [want[i:i + batch] for i in range(0, len(want), batch)][:n // (batch * world)]
            assert [list(b) for b in ours] == want


@pytest.mark.parametrize(("world", "micro", "accum"), [(2, 16, 1), (1, 16, 2), (4, 8, 1), (8, 2, 2), (1, 32, 1)])
def test_every_layout_of_a_global_batch_trains_the_same_samples_each_step(world, micro, accum):
    """Global batch 32 over any ranks x micro x accum: step k trains positions [32k, 32k+32) of
    the epoch's order, each once; the same chunk (micro-batch) draws from the same seed."""
    from trainer.data import GlobalBatches

    ranks = [GlobalBatches(320, 1, r, world, micro, accum) for r in range(world)]
    order = ranks[0].order().tolist()
    per_rank = [[list(b) for b in g] for g in ranks]
    for step in range(10):
        trained = [i for r in range(world) for b in per_rank[r][step * accum:(step + 1) * accum] for i in b]
        assert sorted(trained) == sorted(order[32 * step:32 * step + 32])
    if micro == 16:  # chunks of 16: chunk 1 of each step is the same samples and seed, whoever trains it
        # (rank 1 % world, as its micro-batch 1 // world of the step)
        two = GlobalBatches(320, 1, 1, 2, 16, 1)  # rank 1 of 2: chunk 1 of each step
        assert [list(b) for b in two][:3] == [per_rank[1 % world][(s * accum) + 1 // world] for s in range(3)]
        assert two.seed_of(4) == ranks[1 % world].seed_of(4 * accum + 1 // world)


@pytest.mark.parametrize(("global_batch", "world", "micro_max", "layout"), [
    (128, 2, 64, (64, 1)), (128, 1, 64, (64, 2)), (128, 4, 64, (32, 1)), (128, 8, 16, (16, 1)),
    (256, 2, 48, (32, 4)), (96, 3, 64, (32, 1)), (96, 4, 7, (6, 4)),
])
def test_a_global_batch_is_laid_out_with_the_largest_micro_batch_that_fits(global_batch, world, micro_max, layout):
    from trainer.data import layout_for

    micro, accum = layout_for(global_batch, world, micro_max)
    assert (micro, accum) == layout and world * micro * accum == global_batch and micro <= micro_max


def test_a_global_batch_that_does_not_split_over_the_ranks_has_no_layout():
    from trainer.data import layout_for

    with pytest.raises(ValueError, match="128 samples does not split evenly over 3 ranks"):
        layout_for(128, 3, 64)


# -- real runs: 2 ranks, gloo ------------------------------------------------------------


@pytest.mark.slow
def test_the_cnn_workload_matches_the_textbook_ddp_loop(tmp_path):
    """Same data, seeds and steps as a plain DDP loop: equal per-step losses and parameters.

    With the default channels-last layout (different convolution kernels) to float tolerance;
    with the plain layout, bit for bit. Ours runs DDP with static_graph (`train.static_graph:
    auto` on `cnn`), the textbook loop with DDP's defaults: the option changes no result.
    """
    steps = 30
    textbook = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(REPO / "bench" / "textbook_ddp.py"),
         str(tmp_path / "textbook.json"), str(steps), "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert textbook.returncode == 0, textbook.stderr[-3000:]
    reference = json.loads((tmp_path / "textbook.json").read_text())

    for name, channels_last in (("eq", True), ("exact", False)):
        ours = run(write_job(tmp_path, name, {"max_steps": steps, "channels_last": channels_last}), tmp_path)
        assert ours.returncode == 0, ours.stdout[-3000:]
        assert "static_graph True (auto: the workload 'cnn' uses every parameter" in ours.stdout
        assert "memory: freed memory kept for reuse" in ours.stdout  # train.keep_freed_memory
        assert "DDP: gloo event loop at idle priority" in ours.stdout  # train.gloo_loop_idle
        assert "cpus: local rank 0 bound to CPUs" in ours.stdout or len(os.sched_getaffinity(0)) < 2  # train.bind_cpus
        run_dir = tmp_path / "runs" / name
        losses = step_losses(run_dir)
        assert len(losses) == len(reference["losses"]) == steps
        s = summary(run_dir)
        assert s["status"] == "completed" and s["steps"] == steps and s["world_size"] == 2
        # Identical on every rank: the per-rank files and the summary agree.
        shas = {(run_dir / f"params-rank{r}.sha256").read_text().strip() for r in (0, 1)}
        assert shas == {s["final_params_sha256"]} and s["params_identical"]
        assert [r["rank"] for r in s["ranks"]] == [0, 1] and s["hostnames"]
        assert all(set(r) == {"rank", "hostname", "params_sha256", "buffers_sha256"} for r in s["ranks"]), s["ranks"]
        for key in ("samples_per_s", "final_loss", "wall_s", "first_step_s"):
            assert isinstance(s[key], float) and s[key] > 0, key
        assert (run_dir / "checkpoints" / "FINISHED").exists()
        if channels_last:
            assert losses == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
        else:
            assert losses == reference["losses"]
            assert s["final_params_sha256"] == reference["params_sha256"]


@pytest.mark.slow
def test_loss_goes_down_with_accumulation_clipping_and_a_schedule(tmp_path):
    job = write_job(tmp_path, "down", {
        "max_steps": 40, "data_samples": 4096, "lr": 0.05, "momentum": 0.9, "grad_accum": 2,
        "grad_clip": 5.0, "lr_schedule": "cosine", "warmup_steps": 5, "eval_every_epochs": 1,
        "plot": True, "batch_size": 32})
    result = run(job, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    run_dir = tmp_path / "runs" / "down"
    losses = step_losses(run_dir)
    s = summary(run_dir)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2, losses
    assert s["eval_loss"] < math.log(10) - 0.2 and s["eval_accuracy"] > 0.3, s
    assert s["params_identical"] and s["global_batch"] == 32 * 2 * 2
    assert (run_dir / "metrics.png").stat().st_size > 1000
    lrs = [r["lr"] for r in records(run_dir) if "lr" in r]
    assert lrs[0] == pytest.approx(0.01) and lrs[4] == pytest.approx(0.05) and lrs[-1] < 0.01


@pytest.mark.slow
def test_an_interrupted_run_resumes_to_the_same_parameters(tmp_path):
    """Uninterrupted vs stopped mid-epoch, newest checkpoint corrupted, resumed: bit for bit."""
    train = {"max_steps": 24, "epochs": 2, "data_samples": 2048}  # 16 steps per epoch: crosses one
    ckpt = {"every_steps": 5, "keep": 3}
    whole = run(write_job(tmp_path, "whole", train, ckpt), tmp_path)
    assert whole.returncode == 0, whole.stdout[-3000:]

    job = write_job(tmp_path, "parts", train, ckpt)
    first = run(job, tmp_path, DDPKIT_STOP_AT_STEP="11")
    assert first.returncode == 143, first.stdout[-3000:]
    ckpt_dir = tmp_path / "runs" / "parts" / "checkpoints"
    saved = [s for s, _ in checkpoint.checkpoints(ckpt_dir)]
    assert saved[0] > 10 and 10 in saved and not (ckpt_dir / "FINISHED").exists()
    assert summary(tmp_path / "runs" / "parts")["status"] == "stopped"
    newest = checkpoint.checkpoints(ckpt_dir)[0][1]
    newest.write_bytes(newest.read_bytes()[:-100])  # a truncated write: the loader must notice

    second = run(job, tmp_path)
    assert second.returncode == 0, second.stdout[-3000:]
    assert f"{newest.name} (step {saved[0]}) is unusable" in second.stdout
    a, b = summary(tmp_path / "runs" / "whole"), summary(tmp_path / "runs" / "parts")
    assert b["resumed_from_step"] == 10 and b["steps"] == a["steps"] == 24
    assert b["final_params_sha256"] == a["final_params_sha256"] is not None
    # The per-step losses after the resume point are the uninterrupted run's too.
    assert step_losses(tmp_path / "runs" / "parts")[-14:] == step_losses(tmp_path / "runs" / "whole")[-14:]


@pytest.mark.slow
def test_sigterm_checkpoints_exits_143_and_the_rerun_resumes(tmp_path):
    job = write_job(tmp_path, "term", {"max_steps": 100, "epochs": 10, "data_samples": 2048},
                    {"every_steps": 1000})
    run_dir = tmp_path / "runs" / "term"
    proc = start(job, tmp_path)
    out = stop_after_steps(proc, run_dir, 3, signal.SIGTERM)
    assert proc.returncode == 143, out[-3000:]
    s = summary(run_dir)
    assert s["status"] == "stopped" and 3 <= s["steps"] < 100
    assert [step for step, _ in checkpoint.checkpoints(run_dir / "checkpoints")] == [s["steps"]]

    again = run(job, tmp_path)
    assert again.returncode == 0, again.stdout[-3000:]
    done = summary(run_dir)
    assert done["resumed_from_step"] == s["steps"] and done["steps"] == 100 and done["params_identical"]

    # A finished job started again exits 0 at once and trains nothing.
    n = len(records(run_dir))
    third = run(job, tmp_path)
    assert third.returncode == 0 and "nothing to do" in third.stdout
    assert len(records(run_dir)) == n


@pytest.mark.slow
def test_gpt_and_a_user_workload_run_in_one_process(tmp_path):
    (tmp_path / "my_workload.py").write_text(
        "import torch\nfrom trainer.models import Workload\nfrom trainer.data import TensorPairs\n"
        "def build(cfg):\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    x = torch.randn(256, 4, generator=g); y = (x.sum(1) > 0).long()\n"
        "    torch.manual_seed(0)\n"
        "    return Workload(torch.nn.Linear(4, 2), TensorPairs(x, y), TensorPairs(x[:64], y[:64]))\n")
    gpt = write_job(tmp_path, "gpt", {
        "model": "gpt", "max_steps": 3, "batch_size": 4, "eval_every_epochs": 1,
        "model_args": {"d_model": 32, "layers": 1, "heads": 2, "seq_len": 16, "samples": 64}})
    user = write_job(tmp_path, "user", {"model": "my_workload:build", "epochs": 2, "batch_size": 32,
                                        "lr": 0.5, "eval_every_epochs": 1})
    env_extra = {"PYTHONPATH": f"{REPO}:{tmp_path}"}
    for job in (gpt, user):
        result = subprocess.run([sys.executable, "-m", "trainer"], cwd=tmp_path, capture_output=True,
                                text=True, timeout=240,
                                env={"PATH": "/usr/bin:/bin", "DDPKIT_JOB_FILE": str(job), **env_extra})
        assert result.returncode == 0, result.stderr[-3000:]
    assert summary(tmp_path / "runs" / "gpt")["steps"] == 3
    s = summary(tmp_path / "runs" / "user")
    assert s["steps"] == 16 and s["world_size"] == 1 and s["eval_accuracy"] > 0.8


def test_bad_train_settings_exit_2_with_one_line(tmp_path):
    job = write_job(tmp_path, "bad", {"model": "nosuchmodule:build"})
    result = subprocess.run([sys.executable, "-m", "trainer"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO),
                                              "DDPKIT_JOB_FILE": str(job)})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "ddpkit: train.model: cannot load 'nosuchmodule:build': No module named 'nosuchmodule'"]


@pytest.mark.parametrize("samples", [1, 1000, 4096])
def test_a_smaller_cnn_data_set_is_the_full_ones_first_rows_bit_for_bit(samples):
    """synthetic_images draws only the rows it returns when no held-out set follows (a worker
    start, so a restart, pays for it): they must equal the full set's, which the textbook loop
    (bench/textbook_ddp.py) builds with the recipe in the docstring."""
    import torch

    from trainer.data import synthetic_images

    g = torch.Generator().manual_seed(1234)
    templates = torch.randn(10, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (16384,), generator=g)
    x = torch.randn(16384, 3, 32, 32, generator=g) + 0.5 * templates[y]
    small, held_out = synthetic_images(samples, held_out=False)
    assert held_out is None and len(small) == samples
    assert torch.equal(small.x, x[:samples]) and torch.equal(small.y, y[:samples])
    full, held_out = synthetic_images(samples, held_out=True)  # the eval set continues the generator
    assert torch.equal(full.x, x[:samples]) and torch.equal(full.y, y[:samples])
    y_eval = torch.randint(0, 10, (2048,), generator=g)
    assert torch.equal(held_out.y, y_eval)
    assert torch.equal(held_out.x, torch.randn(2048, 3, 32, 32, generator=g) + 0.5 * templates[y_eval])
