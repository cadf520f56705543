"""`k8s.avoid_lost_nodes`: a node lost under a job gets none of the job's pods again.

Kubernetes has no per-job list of nodes to stay off (Slurm's `--exclude`): the pod that the Job
controller, the training operator or JobSet makes after a failure goes wherever the scheduler
finds room, and a node that went NotReady and came back (a kernel hang, a flapping link, a GPU
driver reset) is as good as any other to it. So every pod ddpkit renders carries a required
node affinity: only nodes *without* the label `avoid.ddpkit.io/<job name>` (pod.AVOID_LABEL).

The label is put on by whoever watches the job: each refresh of `ddpkit status --watch` (and
of `Handle.wait()` in the Python API) reads the job's pods and labels the node of each pod that
the node lifecycle controller marked lost (`pod_on_lost_node`) `avoid.ddpkit.io/<name>=lost`.
From then on the job's new pods go elsewhere, or wait, Unschedulable in the scheduler's words
("didn't match Pod's node affinity/selector"), when no other node fits. `ddpkit cancel` takes
the labels off again, and so does the watcher once the job has ended. Labelling a node needs
`patch` on nodes (cluster-scoped: a cluster admin's right, or a ClusterRole for it): without
it the watcher says so once and carries on, and the job behaves as Kubernetes does alone.
"""

from __future__ import annotations

from deploy.k8s.cluster import ApiError, Cluster, connect, parse_handle
from deploy.k8s.pod import AVOID_LABEL
from deploy.kube import pod_label_selector

#: the label's value on a node lost under the job
LOST = "lost"


def label_key(name: str) -> str:
    return AVOID_LABEL + name


def pod_on_lost_node(pod: dict, ended: bool = False) -> str | None:
    """`on lost node N: ...` for a pod whose node stopped answering, read from the pod alone
    (a user may not be allowed to read nodes): the node lifecycle controller marks a Running
    pod Ready=False while its containers were last reported ready, and the taint-eviction
    controller then deletes it (DisruptionTarget, DeletionByTaintManager). Nothing confirms
    the deletion on a dead node: the pod is replaced once the node is deleted or tainted
    `node.kubernetes.io/out-of-service` (PodGC force-deletes it then). `ended`: the job has
    ended (nothing will replace the pod): the node's words only.

    A job that ended FAILED because of the lost node (restarts used up, or 0) keeps such a pod,
    Terminating, until the node is deleted or tainted out of service: until then `status`
    names the node; after, the pod and its node are gone from the API and `status` says
    FAILED alone."""
    status = pod.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    node = (pod.get("spec") or {}).get("nodeName") or "?"
    disrupted = conditions.get("DisruptionTarget", {})
    if disrupted.get("status") == "True" and disrupted.get("reason") == "DeletionByTaintManager":
        said = f"on lost node {node}: NotReady, the pod evicted (DeletionByTaintManager)"
        return said if ended else (said + "; it is replaced once the node is deleted or tainted "
                                   "node.kubernetes.io/out-of-service")
    if (status.get("phase") == "Running" and conditions.get("Ready", {}).get("status") == "False"
            and conditions.get("ContainersReady", {}).get("status") == "True"):
        said = f"on lost node {node}: NotReady (containers last reported running)"
        return said if ended else said + ", eviction after k8s.node_lost_after"
    return None


def lost_nodes(pods: list[dict]) -> list[str]:
    """The nodes that the job's pods were lost on (NotReady under them, or evicted from them)."""
    return sorted({p["spec"]["nodeName"] for p in pods
                   if (p.get("spec") or {}).get("nodeName") and pod_on_lost_node(p)})


def avoid_lost_nodes(handle: str, *, cluster: Cluster | None = None) -> list[str]:
    """Label every node lost under the job so that its pods stay off it; the nodes labelled now
    (not those labelled before). ApiError when the cluster refuses (no `patch` on nodes)."""
    h, cluster = parse_handle(handle), connect(cluster)
    selector = pod_label_selector(h.name)
    key = label_key(h.name)
    lost = lost_nodes(cluster.pods(h.namespace, selector))
    if not lost:
        return []
    marked = {n["metadata"]["name"] for n in cluster.nodes(key)}
    new = [node for node in lost if node not in marked]
    for node in new:
        cluster.label_node(node, key, LOST)
    return new


def forget(handle: str, *, cluster: Cluster | None = None) -> list[str]:
    """Take the job's avoid label off every node that has it; those nodes. Nothing (and no
    error) without the right to list or patch nodes."""
    h, cluster = parse_handle(handle), connect(cluster)
    key = label_key(h.name)
    try:
        marked = [n["metadata"]["name"] for n in cluster.nodes(key)]
        for node in marked:
            cluster.label_node(node, key, None)
    except ApiError:
        return []
    return marked


def refused(err: ApiError, node: str) -> str:
    """One line for a cluster that would not let us label `node`."""
    return (f"cannot label node {node} ({err.status} {err.reason or err.message}): the job's pods may be "
            "placed on it again; k8s.avoid_lost_nodes needs the right to patch nodes (ask a cluster admin)")


def tend(handle: str, ended: bool, *, cluster: Cluster | None = None) -> list[str]:
    """A watcher's refresh: while the job runs, label the nodes lost under it; once it has
    ended, take the labels off. The lines to show (a watcher shows each once)."""
    key = label_key(parse_handle(handle).name)
    if ended:
        return [f"{handle}: node {node} may take the job's pods again (label {key} removed)"
                for node in forget(handle, cluster=cluster)]
    try:
        new = avoid_lost_nodes(handle, cluster=cluster)
    except ApiError as err:
        return [f"{handle}: " + refused(err, "(a node lost under the job)")]
    return [f"{handle}: node {node} was lost under the job: its pods stay off it (label {key}={LOST})"
            for node in new]
