"""Entry points ddpkit declares for other packages (pyproject.toml), kept apart from `trainer`
(a common top-level name: a project with its own `trainer/` package must not break) and safe to
load anywhere: outside a ddpkit script job they import nothing and give nothing.

- `lightning_callbacks`, `pytorch_lightning_callbacks`: Lightning's callbacks factories
  (trainer/integrations.py: the planned steps of `fit` for `ddpkit status`).
"""

import os

_UNDER_DDPKIT = "DDPKIT_RUN_DIR"  # trainer.contract.RUN_DIR_VAR: set for a guarded script's workers


def _callbacks(name: str) -> list:
    if not os.environ.get(_UNDER_DDPKIT):
        return []
    try:
        from trainer import integrations

        return getattr(integrations, name)()
    except Exception:  # noqa: BLE001  (an ETA is never worth a failed fit)
        return []


def lightning_callbacks() -> list:
    return _callbacks("lightning_callbacks")


def pytorch_lightning_callbacks() -> list:
    return _callbacks("pytorch_lightning_callbacks")
