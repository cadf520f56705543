"""`import ddpkit`: the Python API (deploy/api.py; the README's "Python API" section).

The distribution is called ddpkit and its code lives in the `deploy` and `trainer` packages;
this one-line module is the name users look for. `Job`, `Handle`, `InvalidJob`,
`RuntimeFailure`, `TARGETS`, `FLAVORS` and `STATES` are the public names.
"""

from deploy.api import *  # noqa: F403
from deploy.api import __all__  # noqa: F401
