"""`python -m trainer` runs one training process (what `trainer.launch` starts per rank)."""

from trainer.train import entry

entry()
