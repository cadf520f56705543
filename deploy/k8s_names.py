"""Compatibility shim: the names moved to `deploy.k8s.names` and the flavor modules
(`deploy.k8s.pytorchjob` etc.). Kept until `deploy.lint` imports from there; do not add to it."""

from deploy.k8s.names import *  # noqa: F401,F403
from deploy.k8s.names import COMPLETION_INDEX_KEY  # noqa: F401
from deploy.k8s.pytorchjob import CONTAINER as PYTORCHJOB_CONTAINER  # noqa: F401
from deploy.k8s.pytorchjob import PORT as PYTORCHJOB_PORT  # noqa: F401
from deploy.k8s.pytorchjob import PORT_NAME as PYTORCHJOB_PORT_NAME  # noqa: F401
from deploy.k8s.pytorchjob import REPLICA_INDEX_LABEL as PYTORCHJOB_REPLICA_INDEX  # noqa: F401
from deploy.k8s.pytorchjob import REPLICA_TYPE_LABEL as PYTORCHJOB_REPLICA_TYPE  # noqa: F401
from deploy.k8s.trainjob import NODE as TRAINJOB_NODE  # noqa: F401
from deploy.k8s.trainjob import PORT as TRAINJOB_PORT  # noqa: F401

#: The training container of each flavor.
CONTAINER_NAME = {"pytorchjob": "pytorch", "trainjob": "node", "jobset": "trainer", "job": "trainer"}
