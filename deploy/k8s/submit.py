"""Submit, watch and cancel rendered Kubernetes jobs through the API.

`submit` sends exactly what `ddpkit render k8s` prints, by server-side apply with field manager
`ddpkit` (as `kubectl apply --server-side --field-manager=ddpkit` would; `--dry-run` asks the
server to validate without persisting). Every verb takes an injectable `cluster` (the
`Cluster` protocol of deploy/k8s/cluster.py, where the real client, the handles and the API
errors' lines are). What a flavor's objects are, how its conditions read and how its pods are
ranked is the flavor module's (`deploy.k8s.<flavor>`).

Handles are `k8s://NAMESPACE/FLAVOR/NAME`. States are the vocabulary shared with Slurm:
PENDING, RUNNING, RESTARTING, SUCCEEDED, FAILED, CANCELLED (each flavor's `state` maps its
conditions).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from deploy import workdir
from deploy.errors import RuntimeFailure, UserError
from deploy.k8s import flavor as flavor_module
from deploy.k8s import flavor_of_kind
from deploy.k8s import pod as podlib
from deploy.k8s.blame import forget, pod_on_lost_node
from deploy.k8s.cluster import ApiError, Cluster, Handle, connect, explain, parse_handle
from deploy.kube import (
    KUEUE_JOB_UID_LABEL,
    KUEUE_QUEUE_LABEL,
    STATES,
    configmap_name,
    pod_label_selector,
)
from deploy.logs import LineWriter, Query, pick_node
from deploy.progress import TAIL_LINES, Report, last_record
from trainer.contract import HANG_VERDICT_PREFIX, NPROC_PER_NODE_VAR, workdir_record

__all__ = ["STATES", "submit", "status", "logs", "cancel", "parse_handle"]

# --------------------------------------------------------------------------------------------
# Verbs


def submit(job, *, flavor: str | None = None, dry_run: bool = False, source: str = "job.yaml",
           cluster: Cluster | None = None) -> str:
    """Apply every rendered object (server-side dry run when asked); return the handle.

    A job is a run, not a desired state: if its workload already exists, submit refuses (cancel
    it first) rather than re-applying onto a running or finished job. Objects are applied in
    render order (ConfigMap, Service, workload). If one fails, the ones this call applied are
    deleted again: nothing half-submitted stays behind. Then the ConfigMap and Service are
    applied once more with the workload as their owner, so Kubernetes deletes them with it (on
    cancel, or after ttlSecondsAfterFinished) and the same job can be submitted again.
    """
    from deploy.k8s.render import render_objects

    flavor = flavor or job.k8s.flavor
    objects = render_objects(job, flavor=flavor)
    cluster = connect(cluster)
    workload = objects[-1]
    kind, ns, name = workload["kind"], job.k8s.namespace, job.name
    try:
        cluster.get(kind, ns, name)
    except ApiError as err:
        if err.status != 404:
            raise RuntimeFailure(explain(err, kind, ns, name, "get")) from None
    else:
        raise RuntimeFailure(f"create {kind} {ns}/{name}: already exists; cancel it first "
                             f"(ddpkit cancel k8s://{ns}/{flavor}/{name}) or rename the job")
    if not dry_run and workdir.image_of(job):
        ship_workdir_image(job)
    applied: list[tuple[dict, dict]] = []
    for obj in objects:
        meta = obj["metadata"]
        try:
            answer = cluster.apply(obj, dry_run=dry_run)
        except ApiError as err:
            _roll_back(cluster, [o for o, _ in applied])
            raise RuntimeFailure(explain(err, obj["kind"], meta["namespace"], meta["name"], "create")) from None
        if not dry_run:
            applied.append((obj, answer))
    handle = Handle(ns, flavor, name)
    if job.workdir is not None:
        print(f"ddpkit: {'would ship' if dry_run else 'shipped'}: {podlib.shipped(job)}", file=sys.stderr)
    if dry_run:
        return f"{handle} (dry run: the server accepted every object)"
    uid = (applied[-1][1].get("metadata") or {}).get("uid")
    if uid:
        # no blockOwnerDeletion: setting it needs rights on the owner's finalizers, which
        # many users lack; garbage collection deletes the dependents either way
        owner = {"apiVersion": workload["apiVersion"], "kind": kind, "name": name, "uid": uid}
        for obj, _ in applied[:-1]:
            owned = {**obj, "metadata": {**obj["metadata"], "ownerReferences": [owner]}}
            try:
                cluster.apply(owned, dry_run=False)
            except ApiError:
                pass  # the job runs either way; `ddpkit cancel` deletes it explicitly
    return str(handle)


def ship_workdir_image(job) -> None:
    """Build the tree's thin image (`workdir.image`) and put it where the nodes find it: pushed,
    or, on ddpkit's own testbed (KUBECONFIG is the testbed's), loaded into its nodes."""
    from deploy import image as images
    from deploy.testbed import k8s as testbed

    tag = workdir.image_of(job)
    built = images.build_workdir_image(job.image, workdir.snapshot(job), tag)
    if os.environ.get("KUBECONFIG") == str(testbed.kubeconfig()):
        start = time.monotonic()
        testbed.load_image(tag)
        sent = f"loaded into the testbed's nodes in {time.monotonic() - start:.1f}s"
    else:
        sent = f"pushed in {images.push(tag):.1f}s"
    print(f"ddpkit: workdir image {tag}: built in {built:.1f}s, {sent}", file=sys.stderr)


def _roll_back(cluster: Cluster, applied: list[dict]) -> None:
    for obj in reversed(applied):
        try:
            cluster.delete(obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        except ApiError:
            pass  # best effort; the first error is the one worth reporting


def _get(cluster: Cluster, handle: Handle) -> dict:
    try:
        return cluster.get(handle.kind, handle.namespace, handle.name)
    except ApiError as err:
        raise RuntimeFailure(explain(err, handle.kind, handle.namespace, handle.name, "get")) from None


def status(handle: str, *, cluster: Cluster | None = None) -> str:
    h = parse_handle(handle)
    return status_from(h.kind, _get(connect(cluster), h))


def describe(handle: str, *, cluster: Cluster | None = None) -> str:
    """The state, then what holds the job's newest pods up, in the scheduler's and the
    kubelet's words: `PENDING (Unschedulable: 0/2 nodes are available: 2 Insufficient
    nvidia.com/gpu.)`, `RUNNING (1 of 2 pods not scheduled: Unschedulable: ...)`,
    `PENDING (ImagePullBackOff: ...)`."""
    return _state_line(*_workload_and_pods(parse_handle(handle), connect(cluster)))[0]


def _workload_and_pods(h: Handle, cluster: Cluster) -> tuple[Handle, dict, dict[int, dict]]:
    obj = _get(cluster, h)
    if status_from(h.kind, obj) == "QUEUED":
        obj[KUEUE_WORKLOAD] = kueue_workload(cluster, h.namespace, obj)
    selector = pod_label_selector(h.name)
    try:
        pods = pods_by_rank(h.flavor, cluster.pods(h.namespace, selector))
    except ApiError:  # no permission to list pods: the workload's state alone
        pods = {}
    for pod in pods.values():  # scheduled, its containers not created: a volume the kubelet cannot mount?
        if creating(pod):
            try:
                pod[MOUNT_EVENTS] = cluster.events(h.namespace, pod["metadata"]["name"], "FailedMount")
            except ApiError:  # no permission to list events
                pass
    return h, obj, pods


#: where `_workload_and_pods` keeps a creating pod's FailedMount events (not a pod field)
MOUNT_EVENTS = "ddpkit.failedMountEvents"
#: where `_workload_and_pods` keeps a queued job's Kueue Workload (not a field of the job)
KUEUE_WORKLOAD = "ddpkit.kueueWorkload"


def kueue_workload(cluster: Cluster, namespace: str, obj: dict) -> dict | None:
    """The Workload Kueue made for the job (label kueue.x-k8s.io/job-uid); None before Kueue
    made it, or when the user may not read Workloads."""
    uid = (obj.get("metadata") or {}).get("uid")
    if not uid:
        return None
    try:
        found = cluster.listed("Workload", namespace, f"{KUEUE_JOB_UID_LABEL}={uid}")
    except ApiError:
        return None
    return found[0] if found else None


def queued_because(job_obj: dict) -> str:
    """Kueue's words for why a queued job waits, from its Workload's conditions: why it was
    evicted, if it was (`Preempted: Preempted to accommodate a workload ...`), then why it is not
    admitted (`Pending: couldn't assign flavors to pod set main: insufficient unused quota for
    cpu in flavor ..., 800m more needed`)."""
    queue = ((job_obj.get("metadata") or {}).get("labels") or {}).get(KUEUE_QUEUE_LABEL)
    workload = job_obj.get(KUEUE_WORKLOAD)
    if not workload:
        return f"in LocalQueue {queue}: Kueue has not made its Workload yet"
    conditions = {c.get("type"): c for c in (workload.get("status") or {}).get("conditions") or []}
    said = [f"{c.get('reason') or kind}: {str(c.get('message') or '').strip()[:200]}".rstrip(": ")
            for kind, status in (("Evicted", "True"), ("QuotaReserved", "False"))
            if (c := conditions.get(kind)) and c.get("status") == status]
    return "; ".join(said) or f"in LocalQueue {queue}: waiting for admission"


def creating(pod: dict) -> bool:
    """Scheduled, and every container still waiting to be created (ContainerCreating)."""
    status = pod.get("status") or {}
    scheduled = any(c.get("type") == "PodScheduled" and c.get("status") == "True" for c in status.get("conditions") or [])
    waiting = [((c.get("state") or {}).get("waiting") or {}).get("reason")
               for c in status.get("initContainerStatuses", []) + status.get("containerStatuses", [])]
    return scheduled and status.get("phase") == "Pending" and all(w in ("ContainerCreating", "PodInitializing", None)
                                                                  for w in waiting)


def _state_line(h: Handle, obj: dict, pods: dict[int, dict]) -> tuple[str, dict[int, dict]]:
    state = status_from(h.kind, obj)
    if state == "QUEUED":
        return f"QUEUED ({queued_because(obj)})", pods
    if state == "FAILED":  # a pod still bound to a node that stopped answering: the node is why
        lost = [(rank, said) for rank, said in ((r, pod_on_lost_node(p, ended=True)) for r, p in sorted(pods.items()))
                if said]
        return (f"FAILED (node rank {lost[0][0]} {lost[0][1]})" if lost else state), pods
    if state not in ("PENDING", "RUNNING", "RESTARTING"):
        return state, pods
    held = [why for why in map(pod_held_up, pods.values()) if why]
    if not held:
        return state, pods
    if len(held) < len(pods) or state != "PENDING":
        return f"{state} ({len(held)} of {len(pods)} pods {held[0]})", pods
    return f"{state} ({held[0]})", pods


#: A container's waiting reasons that mean it will not start by itself (kubelet's words).
STUCK_WAITING = {"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName", "CreateContainerConfigError",
                 "CreateContainerError", "CrashLoopBackOff", "RunContainerError"}


def pod_held_up(pod: dict) -> str | None:
    """Why a pod is not running, when the scheduler or the kubelet says: `not scheduled:
    Unschedulable: <message>` or `waiting: ImagePullBackOff: <message>`; or when its node
    stopped answering (`on lost node N: ...`); None otherwise."""
    status = pod.get("status") or {}
    lost = pod_on_lost_node(pod)
    if lost:
        return lost
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            message = str(condition.get("message") or "").split(" preemption:")[0].strip()
            return f"not scheduled: {condition.get('reason') or 'Unschedulable'}: {message}"
    for container in status.get("initContainerStatuses", []) + status.get("containerStatuses", []):
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in STUCK_WAITING:
            return f"waiting: {waiting['reason']}: {str(waiting.get('message') or '').strip()[:200]}".rstrip(": ")
    mounts = pod.get(MOUNT_EVENTS) or []
    if mounts:  # the kubelet retries a failed mount for ever: the pod stays ContainerCreating
        return f"waiting: FailedMount: {str(mounts[-1].get('message') or '').strip()[:200]}".rstrip(": ")
    return None


def report(handle: str, *, cluster: Cluster | None = None) -> Report:
    """`ddpkit status`'s report: the state line (`describe`), the trainer's newest progress
    record from the end of rank 0's pod log (the user's own `pods/log` permission; the trainer
    needs none), and how long rank 0's pod waited to be scheduled."""
    cluster = connect(cluster)
    h = parse_handle(handle)
    h, obj, by_rank = _workload_and_pods(h, cluster)
    state_line, pods = _state_line(h, obj, by_rank)
    tree = workdir_of(obj)
    pod = pods.get(0)
    if pod is None:
        return Report(state_line, workdir=tree)
    try:
        text = "".join(cluster.log(h.namespace, pod["metadata"]["name"], flavor_module(h.flavor).CONTAINER,
                                   False, tail_lines=TAIL_LINES))
    except ApiError:  # no log yet (the container has not started), or not allowed: the state alone
        return Report(state_line, None, pod_waited(pod), tree)
    return Report(state_line, last_record(text), pod_waited(pod), tree)


def workdir_of(obj: dict) -> dict | None:
    """The tree a `workdir:` job runs, as its pods' env says (deploy/k8s/pod.py `workdir_env`)."""
    def envs(node):
        if isinstance(node, dict):
            if isinstance(node.get("env"), list):
                yield {e.get("name"): e.get("value") for e in node["env"] if isinstance(e, dict)}
            for value in node.values():
                yield from envs(value)
        elif isinstance(node, list):
            for value in node:
                yield from envs(value)

    return next(filter(None, (workdir_record(env) for env in envs(obj.get("spec") or {}))), None)


def pod_failed(pod: dict) -> str | None:
    """The kubelet's words for a training container that ended badly, now or before its last
    restart: `OOMKilled (exit 137) on node-b`; None when none did."""
    status = pod.get("status") or {}
    for container in status.get("containerStatuses") or []:
        for state in ("state", "lastState"):
            ended = _ended_badly(container, state)
            if ended:
                node = (pod.get("spec") or {}).get("nodeName")
                return (f"{ended.get('reason') or 'Error'} (exit {ended.get('exitCode')})"
                        + (f" on {node}" if node else ""))
    return None


def _ended_badly(container: dict, state: str) -> dict:
    """A container status's `state` or `lastState` `terminated` with a non-zero exit, or {}."""
    ended = (container.get(state) or {}).get("terminated") or {}
    return ended if ended and ended.get("exitCode", 0) != 0 else {}


def failed_before_a_restart(pod: dict) -> bool:
    """Whether a container of `pod` failed and the kubelet restarted it (`lastState`): what it
    said is in the previous container's log (`kubectl logs --previous`)."""
    return any(_ended_badly(c, "lastState") for c in (pod.get("status") or {}).get("containerStatuses") or [])


def why(handle: str, *, cluster: Cluster | None = None) -> list[str]:
    """`ddpkit why`: the state line, the first pod whose container failed in the kubelet's
    words, and that pod's log (else rank 0's; a container restarted in place: the previous
    container's log too), read by deploy/why.py."""
    from deploy.why import explain

    cluster = connect(cluster)
    h = parse_handle(handle)
    h, obj, by_rank = _workload_and_pods(h, cluster)
    state_line, pods = _state_line(h, obj, by_rank)
    failed = {rank: said for rank, said in ((r, pod_failed(p)) for r, p in sorted(pods.items())) if said}
    if failed:
        rank, said = next(iter(failed.items()))
        state_line += f" [node rank {rank}: {said}]"
    # every failed pod's log, by node rank (the watchdog's verdict is in the log of the rank
    # that found the hang, on any node, and every other node relays it), else rank 0's
    # (a container restarted in place: the one before the restart first, then the running one)
    text = "".join(_pod_log(cluster, h, pod) for pod in [pods[r] for r in failed] or
                   [p for p in [pods.get(0)] if p is not None])
    if failed and 0 not in failed and 0 in pods and HANG_VERDICT_PREFIX not in text:
        # a relay that came too late: the verdict's reporter is often rank 0, whose pod a
        # failing Job is still deleting (its other lines would only echo the failure)
        text += "".join(line for line in _pod_log(cluster, h, pods[0]).splitlines(keepends=True) if HANG_VERDICT_PREFIX in line)
    return explain(state_line, text, workdir=workdir_of(obj))


def _pod_log(cluster: Cluster, h: Handle, pod: dict) -> str:
    """A pod's log, its last TAIL_LINES ("" when the server has none for it)."""
    text = ""
    for previous in (True, False) if failed_before_a_restart(pod) else (False,):
        try:
            text += "".join(cluster.log(h.namespace, pod["metadata"]["name"], flavor_module(h.flavor).CONTAINER,
                                        False, tail_lines=TAIL_LINES, previous=previous))
        except ApiError:
            continue
    return text


def pod_waited(pod: dict) -> float | None:
    """Seconds from the pod's creation to its PodScheduled condition (None until scheduled)."""
    import datetime

    created = (pod.get("metadata") or {}).get("creationTimestamp")
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "True" and created:
            scheduled = condition.get("lastTransitionTime")
            try:
                delta = datetime.datetime.fromisoformat(str(scheduled)) - datetime.datetime.fromisoformat(str(created))
            except ValueError:
                return None
            return max(0.0, delta.total_seconds())
    return None


def status_from(kind: str, obj: dict) -> str:
    """One of STATES from a workload object: CANCELLED while it is being deleted, QUEUED while
    Kueue holds it suspended (its queue label set; Kueue's webhook suspends it at creation and
    unsuspends it on admission, and suspends it again when it preempts it), else what its flavor
    reads from the conditions."""
    meta = obj.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return "CANCELLED"
    module = flavor_of_kind(kind)
    if module is None:
        raise UserError(f"{kind}: not a kind ddpkit submits")
    state = module.state(obj)
    if state in ("SUCCEEDED", "FAILED") or KUEUE_QUEUE_LABEL not in (meta.get("labels") or {}):
        return state
    suspended: Any = obj
    for key in module.SUSPEND:
        suspended = (suspended or {}).get(key) if isinstance(suspended, dict) else None
    return "QUEUED" if suspended is True else state


def cancel(handle: str, *, cluster: Cluster | None = None, wait_s: float = 300.0,
           poll_s: float = 1.0) -> None:
    """Delete the workload (as its flavor's DELETE_PROPAGATION says: foreground, its pods go
    first; a TrainJob in the background), then its ConfigMap and Service, and wait (up to
    wait_s; 0: not at all) until the workload, what its controller made under its name and its
    pods are gone, as `kubectl delete --cascade=foreground` does: a `submit` of the same name
    before then is refused as "already exists" or meets the old pods.

    A workload already gone (cancelled, or removed after ttlSecondsAfterFinished) is not an
    error while its ConfigMap or Service was still there to delete.
    """
    h = parse_handle(handle)
    cluster = connect(cluster)
    extras = [("ConfigMap", configmap_name(h.name))] + ([("Service", h.name)] if h.flavor == "job" else [])
    missing: ApiError | None = None
    deleted = 0
    propagation = flavor_module(h.flavor).DELETE_PROPAGATION
    for kind, name in [(h.kind, h.name), *extras]:
        try:
            cluster.delete(kind, h.namespace, name, propagation if kind == h.kind else "Foreground")
            deleted += 1
        except ApiError as err:
            if err.status != 404:
                raise RuntimeFailure(explain(err, kind, h.namespace, name, "delete")) from None
            if kind == h.kind:
                missing = err
    if missing is not None and not deleted:
        raise RuntimeFailure(explain(missing, h.kind, h.namespace, h.name, "delete"))
    forget(handle, cluster=cluster)  # k8s.avoid_lost_nodes: the nodes it kept off
    if missing is None and wait_s > 0:
        _wait_until_gone(cluster, h, wait_s, poll_s)


def _wait_until_gone(cluster: Cluster, h: Handle, wait_s: float, poll_s: float) -> None:
    deadline = time.monotonic() + wait_s
    named = [(kind, h.name) for kind in (h.kind, *flavor_module(h.flavor).NAMED_CHILD_KINDS)]
    selector = pod_label_selector(h.name)
    while True:
        left = [f"{kind} {name}" for kind, name in named if _exists(cluster, h, kind, name)]
        left += [f"pod {p['metadata']['name']}" for p in cluster.pods(h.namespace, selector)]
        if not left:
            return
        if time.monotonic() >= deadline:
            raise RuntimeFailure(
                f"{h.kind} {h.namespace}/{h.name} is deleted but still there {wait_s:.0f} s later "
                f"({', '.join(left)}; kubectl get pods -n {h.namespace}); `ddpkit cancel --wait 0` "
                "returns without waiting")
        time.sleep(poll_s)


def _exists(cluster: Cluster, h: Handle, kind: str, name: str) -> bool:
    try:
        cluster.get(kind, h.namespace, name)
    except ApiError as err:
        if err.status == 404:
            return False
        raise RuntimeFailure(explain(err, kind, h.namespace, name, "get")) from None
    return True


# --------------------------------------------------------------------------------------------
# Logs


def pods_by_rank(flavor: str, pods: list[dict]) -> dict[int, dict]:
    """The newest pod of each node rank (a restarted node leaves older pods behind)."""
    module = flavor_module(flavor)
    ranks: dict[int, dict] = {}
    for pod in pods:
        rank = module.node_rank(pod, pods)
        if rank is None:
            continue
        stamp = str(pod["metadata"].get("creationTimestamp", ""))
        if rank not in ranks or stamp >= str(ranks[rank]["metadata"].get("creationTimestamp", "")):
            ranks[rank] = pod
    return ranks


def logs(handle: str, rank: int | None = None, follow: bool = False, *,
         query: Query | None = None, cluster: Cluster | None = None, out=None) -> int:
    """Print the lines `query` asks for (deploy/logs.py; default: node 0's pod); with `follow`,
    until the containers end. A pod is a node: `--rank N` is node N's pod, `--worker-rank R`
    the pod of node R // processes per node (the pod's DDPKIT_NPROC_PER_NODE) less the lines
    that name another rank, `--all` every pod's lines, each starting `[NODE/RANK] `: pod after
    pod in node order, or with `follow` as they come. `--previous`: the container before the
    current one (the kubelet restarted it); a pod its controller deleted and made anew has no
    previous container (its attempt records in the run directory hold what it did)."""
    query = query or Query(rank=rank)
    if query.attempt is not None:
        raise UserError("--attempt: Kubernetes keeps the log of a pod's current container and of "
                        "the one before it only (--previous); a pod its controller replaced is gone")
    h = parse_handle(handle)
    cluster = connect(cluster)
    out = out or sys.stdout
    selector = pod_label_selector(h.name)
    try:
        pods = cluster.pods(h.namespace, selector)
    except ApiError as err:
        raise RuntimeFailure(explain(err, "Pod", h.namespace, selector, "list")) from None
    ranks = pods_by_rank(h.flavor, pods)
    nproc = _nproc_per_node(pods)
    node = query.worker_rank // nproc if query.worker_rank is not None else query.node
    if query.every:
        nodes = sorted(ranks)
        if not nodes:
            raise RuntimeFailure(f"{h}: no pods yet; see `ddpkit status {h}`")
    elif node not in ranks:
        have = ", ".join(str(r) for r in sorted(ranks)) or "none yet"
        asked = (f"worker rank {query.worker_rank} (node rank {node})" if query.worker_rank is not None
                 else f"node rank {node}")
        raise RuntimeFailure(f"{h}: no pod for {asked} (ranks with pods: {have}); see `ddpkit status {h}`")
    else:
        nodes = [node]
    container = flavor_module(h.flavor).CONTAINER
    lock = threading.Lock()

    def read(n: int) -> None:
        pod = ranks[n]["metadata"]["name"]
        lines = LineWriter(out, pick_node(query, n, nproc), lock)
        try:
            chunks = (cluster.log(h.namespace, pod, container, False, previous=True) if query.previous
                      else cluster.log(h.namespace, pod, container, follow))
            for chunk in chunks:
                lines.write(chunk)
        except ApiError as err:
            raise RuntimeFailure(explain(err, "Pod", h.namespace, pod, "read logs of")) from None
        lines.close()

    if follow and len(nodes) > 1 and not query.previous:
        _each_in_a_thread(read, nodes)
    else:
        for n in nodes:
            read(n)
    return 0


def _each_in_a_thread(fn, items: list) -> None:
    """`fn(item)` for every item at once; the first error is raised once all have ended."""
    errors: list[BaseException] = []

    def run(item) -> None:
        try:
            fn(item)
        except BaseException as err:  # noqa: BLE001  (raised below, in the caller's thread)
            errors.append(err)

    threads = [threading.Thread(target=run, args=(item,), daemon=True) for item in items]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _nproc_per_node(pods: list[dict]) -> int:
    """Processes per node from a pod's DDPKIT_NPROC_PER_NODE (the launch contract), else 1."""
    for pod in pods:
        for container in (pod.get("spec") or {}).get("containers") or []:
            for var in container.get("env") or []:
                if var.get("name") == NPROC_PER_NODE_VAR and str(var.get("value", "")).isdigit():
                    return max(int(var["value"]), 1)
    return 1
