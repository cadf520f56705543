"""trainer/script_watch.py's wait for the script's process group, without processes."""

from __future__ import annotations

import importlib.machinery
import sys
import threading
import types

from trainer import script_watch


def partly_imported(initializing: bool) -> types.ModuleType:
    """torch.distributed as `sys.modules` holds it while the main thread still imports it:
    `is_available` defined, `is_initialized` not yet."""
    module = types.ModuleType("torch.distributed")
    module.is_available = lambda: True
    if initializing:
        module.__spec__ = importlib.machinery.ModuleSpec("torch.distributed", None)
        module.__spec__._initializing = True
    return module


def test_a_process_group_module_still_being_imported_is_not_ready(monkeypatch):
    for initializing in (True, False):
        monkeypatch.setitem(sys.modules, "torch.distributed", partly_imported(initializing))
        assert script_watch.group_module() is None
    monkeypatch.delitem(sys.modules, "torch.distributed")
    assert script_watch.group_module() is None
    monkeypatch.undo()
    import torch.distributed

    assert script_watch.group_module() is torch.distributed


def test_the_watchdog_keeps_waiting_while_the_script_imports_torch_distributed(monkeypatch, tmp_path):
    """A tick during the script's `import torch.distributed` (Lightning's imports are long
    enough for one) once ended the watchdog thread with AttributeError: no watchdog on that rank."""
    monkeypatch.setattr(script_watch, "GROUP_POLL_S", 0.01)
    monkeypatch.setitem(sys.modules, "torch.distributed", partly_imported(False))
    with (tmp_path / "rank-0.txt").open("w") as stacks:
        dog = script_watch.ScriptWatchdog(script_watch.ScriptHeartbeat(), stacks, attempt=0, debug_dir=tmp_path,
                                          floor_s=3, factor=10, timeout_s=600)
        threading.Timer(0.2, dog.stop).start()
        dog._run()  # returns once stopped, having polled ~20 times
    assert dog.rank == 0 and dog.world == 1  # never read a group


SITE = "/venv/lib/python3.11/site-packages"
# Lightning's training_step runs inside DDP's forward (pytorch_lightning/strategies/strategy.py
# wraps the module): as a real rank's main thread read it, innermost first, less some frames.
IN_TRAINING_STEP = [
    ("/work/fit.py", 32, "training_step"),
    (f"{SITE}/pytorch_lightning/strategies/strategy.py", 634, "wrapped_forward"),
    (f"{SITE}/torch/nn/modules/module.py", 1789, "_call_impl"),
    (f"{SITE}/torch/nn/parallel/distributed.py", 1715, "_run_ddp_forward"),
    (f"{SITE}/torch/nn/parallel/distributed.py", 1890, "forward"),
    (f"{SITE}/pytorch_lightning/strategies/strategy.py", 390, "training_step"),
    (f"{SITE}/pytorch_lightning/loops/optimization/automatic.py", 131, "closure"),
    (f"{SITE}/torch/optim/adam.py", 227, "step"),
    ("/work/fit.py", 58, "main"),
]
IN_BACKWARD = [
    (f"{SITE}/torch/autograd/graph.py", 979, "_engine_run_backward"),
    (f"{SITE}/torch/_tensor.py", 623, "backward"),
    (f"{SITE}/pytorch_lightning/core/module.py", 1137, "backward"),
    ("/work/fit.py", 58, "main"),
]


def test_a_rank_stuck_in_its_own_code_inside_ddps_forward_waits_for_nothing():
    """The innermost frame that is the script's own or a collective's decides: a DDP frame
    further out (Lightning, a Trainer's model call) is not a wait (it once made a rank stuck in
    Lightning's training_step `deadlock: every rank waits in collective`, naming no line)."""
    assert script_watch.where_is(IN_TRAINING_STEP) == (False, "fit.py:32 in training_step (outside any collective)")
    assert script_watch.where_is(IN_BACKWARD) == (True, "fit.py:58 in main (waiting in _engine_run_backward)")
    broadcast = [(f"{SITE}/torch/nn/parallel/distributed.py", 1600, "_sync_buffers"), *IN_TRAINING_STEP[3:]]
    assert script_watch.where_is(broadcast) == (True, "fit.py:58 in main (waiting in _sync_buffers)")
    assert script_watch.where_is([]) == (False, "? (outside any collective)")
