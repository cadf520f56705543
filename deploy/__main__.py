"""`python -m deploy`, and the `ddpkit` command (pyproject.toml's [project.scripts])."""

import gc
import os

#: pydantic's switch for its plugins (entry points of the group `pydantic`).
PLUGINS_OFF = "PYDANTIC_DISABLE_PLUGINS"


def run() -> int:
    """The CLI, its modules imported as fast as Python can:

    - Importing them makes some 50k objects that the garbage collector tracks, nearly all of
      them alive until the process ends: its passes while they are made would only walk them
      again and again. So it is paused for the imports, and what they made is then frozen out
      of its later passes (the imports' few MB of cyclic garbage stay until exit); what the
      command made is frozen too once it is done, out of the pass at exit (Python does not
      promise to finalize what is left at exit). ~8% of `ddpkit render`'s instructions.
    - pydantic looks for plugins when it builds the first model, reading the metadata of every
      installed package (~2% of `ddpkit render`): ddpkit's own job models, built by the imports,
      are built without plugins. The variable is as it was before once they are built: a
      model built later in this process (the trainer's) gets the installed plugins, as does
      every process the CLI starts.
    """
    gc.disable()
    before = os.environ.get(PLUGINS_OFF)
    os.environ[PLUGINS_OFF] = "__all__"
    try:
        from deploy.cli import main
    finally:
        if before is None:
            del os.environ[PLUGINS_OFF]
        else:
            os.environ[PLUGINS_OFF] = before
        gc.freeze()
        gc.enable()
    code = main()
    gc.freeze()  # nor walk at exit what the command made: its memory goes with the process
    return code


if __name__ == "__main__":
    raise SystemExit(run())
