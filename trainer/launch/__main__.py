"""`python -m trainer.launch`: the node's launcher (trainer/launch/node.py)."""

import sys

from trainer.launch.node import main

sys.exit(main())
