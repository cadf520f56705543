"""`python -m trainer` runs one training process (what `trainer.launch` starts per rank)."""

import sys

from trainer.train import main

sys.exit(main())
