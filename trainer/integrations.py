"""The planned steps of your own script for `ddpkit status`'s percentage and ETA, from the
framework that knows them, with no change to the script.

- Lightning (`lightning` and `pytorch_lightning`) loads callbacks from the entry points
  `lightning.pytorch.callbacks_factory` / `pytorch_lightning.callbacks_factory`: ddpkit declares
  one (pyproject.toml), which gives a callback only under ddpkit's guard; at the start of
  `fit` it reports `trainer.estimated_stepping_batches` (optimizer steps, gradient accumulation
  and `max_steps` counted).
- Hugging Face `Trainer` has no such hook: the guard adds a callback to every `Trainer` made
  (`install_transformers_hook`: once `transformers.trainer` is imported, its `Trainer.__init__`
  ends with `add_callback`), which reports `state.max_steps` at `on_train_begin`.
- A plain loop: `from trainer.integrations import set_total_steps; set_total_steps(n)`, or the
  job file's `steps: n`.

The job file's `steps:` wins over a framework's count.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import math
import sys
from typing import Any

#: The guard's step counter (trainer/script_steps.py), set before the script runs.
CURRENT: Any = None


def set_total_steps(total: int | float) -> None:
    """The script will take `total` optimizer steps in all (this attempt's count included);
    a no-op outside ddpkit, when the job file gives `steps:`, or when `total` is not finite."""
    if CURRENT is not None and CURRENT.progress is not None and not CURRENT.steps_given and math.isfinite(total):
        CURRENT.progress.total_steps = int(total)


def _lightning_callback(base: type) -> Any:
    class DdpkitSteps(base):  # type: ignore[misc, valid-type]
        """Reports Lightning's estimate of the optimizer steps of `fit` to ddpkit."""

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            set_total_steps(trainer.estimated_stepping_batches)

    return DdpkitSteps()


def lightning_callbacks() -> list[Any]:
    """Entry point `lightning.pytorch.callbacks_factory`."""
    if CURRENT is None:
        return []
    from lightning.pytorch import Callback

    return [_lightning_callback(Callback)]


def pytorch_lightning_callbacks() -> list[Any]:
    """Entry point `pytorch_lightning.callbacks_factory`."""
    if CURRENT is None:
        return []
    from pytorch_lightning import Callback

    return [_lightning_callback(Callback)]


def _add_transformers_callback(module: Any) -> None:
    """Every `Trainer` of this `transformers.trainer` module gets the callback."""
    from transformers.trainer_callback import TrainerCallback

    class DdpkitSteps(TrainerCallback):
        """Reports `Trainer`'s planned optimizer steps to ddpkit."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            set_total_steps(state.max_steps)

    made = module.Trainer.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        self.add_callback(DdpkitSteps)

    module.Trainer.__init__ = init


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `_add_transformers_callback` once `transformers.trainer` has been executed."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "transformers.trainer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            load(module)
            try:
                _add_transformers_callback(module)
            except Exception as e:  # noqa: BLE001  (an ETA is never worth a failed import)
                print(f"ddpkit: no step total from transformers ({type(e).__name__}: {e})", file=sys.stderr)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install(steps: Any) -> None:
    """The guard, before the script runs: `steps` is the rank's counter."""
    global CURRENT
    CURRENT = steps
    if steps.progress is not None:  # rank 0 keeps the record
        sys.meta_path.insert(0, _AfterImport())
