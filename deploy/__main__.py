"""`python -m deploy`, and the `ddpkit` command (pyproject.toml's [project.scripts])."""

import gc


def run() -> int:
    """The CLI. Importing it makes some 50k objects that the garbage collector tracks, nearly
    all of them alive until the process ends: its passes while they are made would only walk
    them again and again. So it is paused for the imports, and what they made is then frozen
    out of its later passes, the one at exit included (the import's few MB of cyclic garbage
    stay until exit; `ddpkit render` runs ~7% fewer instructions)."""
    gc.disable()
    try:
        from deploy.cli import main
    finally:
        gc.freeze()
        gc.enable()
    return main()


if __name__ == "__main__":
    raise SystemExit(run())
