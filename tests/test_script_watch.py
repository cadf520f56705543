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
