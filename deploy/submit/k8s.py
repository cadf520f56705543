"""Submit, watch and cancel rendered Kubernetes jobs through the API.

`submit` sends exactly what `ddpkit render k8s` prints (the dry run is the real path minus the
last call: `--dry-run` asks the server to validate without persisting). Every verb takes an
injectable `cluster` (anything with the methods of `KubeCluster`); the real one wraps the
`kubernetes` client, imported only here and only when used, with kubeconfig or in-cluster
credentials.

Handles are `k8s://NAMESPACE/FLAVOR/NAME`. States are the vocabulary shared with Slurm:
PENDING, RUNNING, RESTARTING, SUCCEEDED, FAILED, CANCELLED (`status_from` maps each flavor's
conditions). API errors become one line that names the object and the fix.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from deploy.errors import RuntimeFailure, UserError
from deploy.k8s_names import (
    COMPLETION_INDEX_KEY,
    CONTAINER_NAME,
    FLAVOR_KIND,
    PYTORCHJOB_REPLICA_INDEX,
    PYTORCHJOB_REPLICA_TYPE,
    configmap_name,
    pod_selector,
)

STATES = ("PENDING", "RUNNING", "RESTARTING", "SUCCEEDED", "FAILED", "CANCELLED")

#: kind -> (api group, version, plural); "" is the core group.
KINDS = {
    "ConfigMap": ("", "v1", "configmaps"),
    "Service": ("", "v1", "services"),
    "Job": ("batch", "v1", "jobs"),
    "PyTorchJob": ("kubeflow.org", "v1", "pytorchjobs"),
    "TrainJob": ("trainer.kubeflow.org", "v1alpha1", "trainjobs"),
    "JobSet": ("jobset.x-k8s.io", "v1alpha2", "jobsets"),
}
#: What installs each custom kind (for the missing-CRD message).
INSTALLS = {
    "PyTorchJob": "the Kubeflow training operator (v1)",
    "TrainJob": "Kubeflow Trainer (v2) and its ClusterTrainingRuntimes",
    "JobSet": "the JobSet controller",
}


# --------------------------------------------------------------------------------------------
# Handles


@dataclass(frozen=True)
class Handle:
    namespace: str
    flavor: str
    name: str

    def __str__(self) -> str:
        return f"k8s://{self.namespace}/{self.flavor}/{self.name}"

    @property
    def kind(self) -> str:
        return FLAVOR_KIND[self.flavor]


_HANDLE = re.compile(r"k8s://([a-z0-9]([-a-z0-9]*[a-z0-9])?)/([a-z]+)/([a-z]([-a-z0-9]*[a-z0-9])?)")


def parse_handle(text: str) -> Handle:
    match = _HANDLE.fullmatch(text.strip())
    if not match or match.group(3) not in FLAVOR_KIND:
        raise UserError(f"{text!r} is not a Kubernetes job handle: expected "
                        f"k8s://NAMESPACE/FLAVOR/NAME with FLAVOR one of {', '.join(FLAVOR_KIND)}")
    return Handle(match.group(1), match.group(3), match.group(4))


# --------------------------------------------------------------------------------------------
# The cluster seam


class ApiError(Exception):
    """An API call that failed: HTTP status (0: no answer), reason, server message, details kind."""

    def __init__(self, status: int, reason: str = "", message: str = "", details_kind: str = ""):
        self.status, self.reason, self.message, self.details_kind = status, reason, message, details_kind
        super().__init__(f"{status} {reason}: {message}")


class Cluster(Protocol):
    def create(self, obj: dict, *, dry_run: bool) -> dict: ...
    def get(self, kind: str, namespace: str, name: str) -> dict: ...
    def delete(self, kind: str, namespace: str, name: str) -> None: ...
    def patch(self, kind: str, namespace: str, name: str, body: dict) -> None: ...
    def pods(self, namespace: str, selector: str) -> list[dict]: ...
    def log(self, namespace: str, pod: str, container: str, follow: bool) -> Iterator[str]: ...


class KubeCluster:
    """The real cluster through the `kubernetes` client (kubeconfig, else in-cluster)."""

    def __init__(self) -> None:
        try:
            from kubernetes import client, config
        except ModuleNotFoundError:
            raise RuntimeFailure("talking to Kubernetes needs the Python package 'kubernetes': "
                                 "pip install 'ddpkit[k8s]'") from None
        try:
            # KUBECONFIG read now, not when the client was imported (it caches the variable)
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
        except Exception:
            try:
                config.load_incluster_config()
            except Exception:
                raise RuntimeFailure("no Kubernetes credentials: set KUBECONFIG (or ~/.kube/config) "
                                     "or run inside a cluster") from None
        self._client = client
        self.api = client.ApiClient()
        self.core = client.CoreV1Api(self.api)
        self.batch = client.BatchV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    def _call(self, fn, *args, **kwargs) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._client.ApiException as exc:
            raise api_error_from(exc) from None
        except Exception as exc:  # urllib3 connection errors and the like
            if type(exc).__module__.startswith(("urllib3", "socket", "ssl")) or isinstance(exc, OSError):
                host = self.api.configuration.host
                raise ApiError(0, "Unreachable", f"cannot reach the Kubernetes API at {host}") from None
            raise

    def _dict(self, value: Any) -> dict:
        return value if isinstance(value, dict) else self.api.sanitize_for_serialization(value)

    def create(self, obj: dict, *, dry_run: bool) -> dict:
        kind, ns = obj["kind"], obj["metadata"]["namespace"]
        opts = {"field_validation": "Strict"}
        if dry_run:
            opts["dry_run"] = "All"
        group, version, plural = KINDS[kind]
        if kind == "ConfigMap":
            out = self._call(self.core.create_namespaced_config_map, ns, obj, **opts)
        elif kind == "Service":
            out = self._call(self.core.create_namespaced_service, ns, obj, **opts)
        elif kind == "Job":
            out = self._call(self.batch.create_namespaced_job, ns, obj, **opts)
        else:
            out = self._call(self.custom.create_namespaced_custom_object, group, version, ns,
                             plural, obj, **opts)
        return self._dict(out)

    def get(self, kind: str, namespace: str, name: str) -> dict:
        group, version, plural = KINDS[kind]
        if kind == "Job":
            return self._dict(self._call(self.batch.read_namespaced_job, name, namespace))
        if kind in ("ConfigMap", "Service"):
            fn = getattr(self.core, f"read_namespaced_{'config_map' if kind == 'ConfigMap' else 'service'}")
            return self._dict(self._call(fn, name, namespace))
        return self._dict(self._call(self.custom.get_namespaced_custom_object, group, version,
                                     namespace, plural, name))

    def delete(self, kind: str, namespace: str, name: str) -> None:
        group, version, plural = KINDS[kind]
        # raw response: a DELETE answers a Status or the object, depending on kind and version
        policy = {"propagation_policy": "Foreground", "_preload_content": False}
        if kind == "Job":
            self._call(self.batch.delete_namespaced_job, name, namespace, **policy)
        elif kind == "ConfigMap":
            self._call(self.core.delete_namespaced_config_map, name, namespace, **policy)
        elif kind == "Service":
            self._call(self.core.delete_namespaced_service, name, namespace, **policy)
        else:
            self._call(self.custom.delete_namespaced_custom_object, group, version, namespace,
                       plural, name, **policy)

    def patch(self, kind: str, namespace: str, name: str, body: dict) -> None:
        """A strategic-merge patch of a ConfigMap or Service (what submit needs)."""
        fn = {"ConfigMap": self.core.patch_namespaced_config_map,
              "Service": self.core.patch_namespaced_service}[kind]
        self._call(fn, name, namespace, body, _preload_content=False)

    def pods(self, namespace: str, selector: str) -> list[dict]:
        found = self._call(self.core.list_namespaced_pod, namespace, label_selector=selector)
        return self._dict(found).get("items", [])

    def log(self, namespace: str, pod: str, container: str, follow: bool) -> Iterator[str]:
        resp = self._call(self.core.read_namespaced_pod_log, pod, namespace, container=container,
                          follow=follow, _preload_content=False)
        import codecs

        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # chunks split characters
        try:
            for chunk in resp.stream(4096):
                yield decoder.decode(chunk)
            yield decoder.decode(b"", final=True)
        finally:
            resp.release_conn()


def api_error_from(exc: Any) -> ApiError:
    """An `ApiException` (status, reason, JSON body) as an ApiError."""
    import json

    message, details_kind = "", ""
    try:
        body = json.loads(exc.body or "{}")
        message = body.get("message", "")
        details_kind = (body.get("details") or {}).get("kind", "")
    except (ValueError, TypeError, AttributeError):
        message = str(exc.body or "").strip()[:200]
    return ApiError(int(exc.status or 0), exc.reason or "", message, details_kind)


def explain(err: ApiError, kind: str, namespace: str, name: str, verb: str) -> str:
    """One line for an API error: what failed and what to do."""
    what = f"{kind} {namespace}/{name}"
    if err.status == 0:
        return f"{verb} {what}: {err.message}; check the cluster address in your kubeconfig"
    if err.status == 401:
        return f"{verb} {what}: the cluster rejected the credentials (401); refresh your kubeconfig"
    if err.status == 403:
        group, _, plural = KINDS.get(kind, ("", "", kind.lower() + "s"))
        resource = f"{plural}.{group}" if group else plural
        return (f"{verb} {what}: forbidden (403): you may not {verb} {resource} in namespace "
                f"{namespace}; ask a cluster admin for the RBAC rights")
    if err.status == 404:
        if err.details_kind == "namespaces":
            return f"{verb} {what}: namespace {namespace!r} does not exist; create it or set k8s.namespace"
        if verb == "create" and kind in INSTALLS:
            group, version, _ = KINDS[kind]
            return (f"create {what}: the cluster does not serve {kind} ({group}/{version}); install "
                    f"{INSTALLS[kind]}, or use --flavor job (needs no operator)")
        return f"{verb} {what}: not found (never submitted, cancelled, or removed after finishing)"
    if err.status == 409:
        return (f"create {what}: already exists; cancel it first (ddpkit cancel "
                f"k8s://{namespace}/<flavor>/{name}) or rename the job")
    if err.status in (400, 422):
        return f"{verb} {what}: the cluster rejected it ({err.status}): {err.message}"
    return f"{verb} {what}: Kubernetes API error {err.status} {err.reason}: {err.message}".rstrip(": ")


# --------------------------------------------------------------------------------------------
# Verbs


def _cluster(cluster: Cluster | None) -> Cluster:
    return cluster if cluster is not None else KubeCluster()


def submit(job, *, flavor: str | None = None, dry_run: bool = False, source: str = "job.yaml",
           cluster: Cluster | None = None) -> str:
    """Create every rendered object (server-side dry run when asked); return the handle.

    Objects are created in render order (ConfigMap, Service, workload). If one fails, the ones
    created by this call are deleted again: nothing half-submitted stays behind. Then the
    ConfigMap and Service get the workload as their owner, so Kubernetes deletes them with it
    (on cancel, or after ttlSecondsAfterFinished) and the same job can be submitted again.
    """
    from deploy.render.k8s import parse_objects, render_k8s

    flavor = flavor or job.k8s.flavor
    objects = parse_objects(render_k8s(job, flavor=flavor, source=source))
    cluster = _cluster(cluster)
    created: list[tuple[dict, dict]] = []
    for obj in objects:
        meta = obj["metadata"]
        try:
            answer = cluster.create(obj, dry_run=dry_run)
        except ApiError as err:
            _roll_back(cluster, [o for o, _ in created])
            raise RuntimeFailure(explain(err, obj["kind"], meta["namespace"], meta["name"], "create")) from None
        if not dry_run:
            created.append((obj, answer))
    handle = Handle(job.k8s.namespace, flavor, job.name)
    if dry_run:
        return f"{handle} (dry run: the server accepted every object)"
    workload, answer = created[-1]
    uid = (answer.get("metadata") or {}).get("uid")
    if uid:
        # no blockOwnerDeletion: setting it needs rights on the owner's finalizers, which
        # many users lack; garbage collection deletes the dependents either way
        owner = {"apiVersion": workload["apiVersion"], "kind": workload["kind"],
                 "name": workload["metadata"]["name"], "uid": uid}
        for obj, _ in created[:-1]:
            try:
                cluster.patch(obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"],
                              {"metadata": {"ownerReferences": [owner]}})
            except ApiError:
                pass  # the job runs either way; `ddpkit cancel` deletes it explicitly
    return str(handle)


def _roll_back(cluster: Cluster, created: list[dict]) -> None:
    for obj in reversed(created):
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
    return status_from(h.kind, _get(_cluster(cluster), h))


def _true(obj: dict) -> list[str]:
    """Types of the conditions that hold, in the order the controller wrote them."""
    conditions = (obj.get("status") or {}).get("conditions") or []
    return [c.get("type", "") for c in conditions if str(c.get("status")) == "True"]


def status_from(kind: str, obj: dict) -> str:
    """One of STATES from a workload object's status (per flavor)."""
    if (obj.get("metadata") or {}).get("deletionTimestamp"):
        return "CANCELLED"
    true = _true(obj)
    st = obj.get("status") or {}
    if kind == "PyTorchJob":
        # Conditions Created, Running, Restarting, Succeeded, Failed, Suspended: the last that
        # holds is the current one.
        for cond, state in (("Succeeded", "SUCCEEDED"), ("Failed", "FAILED")):
            if cond in true:
                return state
        last = true[-1] if true else ""
        return {"Running": "RUNNING", "Restarting": "RESTARTING"}.get(last, "PENDING")
    if kind == "Job":
        if "Complete" in true or "SuccessCriteriaMet" in true:
            return "SUCCEEDED"
        if "Failed" in true or "FailureTarget" in true:
            return "FAILED"
        if "Suspended" in true:
            return "PENDING"
        if st.get("active"):
            return "RESTARTING" if st.get("failed") and not st.get("ready") else "RUNNING"
        return "RESTARTING" if st.get("failed") else "PENDING"
    if kind in ("JobSet", "TrainJob"):
        if "Completed" in true or "Complete" in true:
            return "SUCCEEDED"
        if "Failed" in true:
            return "FAILED"
        if "Suspended" in true:
            return "PENDING"
        jobs = st.get("replicatedJobsStatus") or st.get("jobsStatus") or []
        active = sum(int(j.get("active", 0) or 0) for j in jobs)
        ready = sum(int(j.get("ready", 0) or 0) for j in jobs)
        if int(st.get("restarts", 0) or 0) > 0 and not ready:
            return "RESTARTING"
        return "RUNNING" if active or ready else "PENDING"
    raise UserError(f"{kind}: not a kind ddpkit submits")


def cancel(handle: str, *, cluster: Cluster | None = None) -> None:
    """Delete the workload (foreground: its pods go first), then its ConfigMap and Service.

    A workload already gone (cancelled, or removed after ttlSecondsAfterFinished) is not an
    error while its ConfigMap or Service was still there to delete.
    """
    h = parse_handle(handle)
    cluster = _cluster(cluster)
    extras = [("ConfigMap", configmap_name(h.name))] + ([("Service", h.name)] if h.flavor == "job" else [])
    missing: ApiError | None = None
    deleted = 0
    for kind, name in [(h.kind, h.name), *extras]:
        try:
            cluster.delete(kind, h.namespace, name)
            deleted += 1
        except ApiError as err:
            if err.status != 404:
                raise RuntimeFailure(explain(err, kind, h.namespace, name, "delete")) from None
            if kind == h.kind:
                missing = err
    if missing is not None and not deleted:
        raise RuntimeFailure(explain(missing, h.kind, h.namespace, h.name, "delete"))


# --------------------------------------------------------------------------------------------
# Logs


def _pod_keys(pod: dict) -> dict[str, str]:
    meta = pod.get("metadata") or {}
    return {**(meta.get("annotations") or {}), **(meta.get("labels") or {})}


def node_rank(flavor: str, pod: dict, *, has_master: bool = True) -> int | None:
    """The node rank a pod runs: PyTorchJob Master is 0 and worker i is i+1 (elastic jobs
    have no Master: worker i is i); JobSet, TrainJob and Job: the completion index."""
    keys = _pod_keys(pod)
    if flavor == "pytorchjob":
        index = str(keys.get(PYTORCHJOB_REPLICA_INDEX, ""))
        if not index.isdigit():
            return None
        is_worker = str(keys.get(PYTORCHJOB_REPLICA_TYPE, "")).lower() == "worker"
        return int(index) + (1 if is_worker and has_master else 0)
    index = str(keys.get(COMPLETION_INDEX_KEY, ""))
    return int(index) if index.isdigit() else None


def pods_by_rank(flavor: str, pods: list[dict]) -> dict[int, dict]:
    """The newest pod of each node rank (a restarted node leaves older pods behind)."""
    has_master = any(str(_pod_keys(p).get(PYTORCHJOB_REPLICA_TYPE, "")).lower() == "master" for p in pods)
    ranks: dict[int, dict] = {}
    for pod in pods:
        rank = node_rank(flavor, pod, has_master=has_master)
        if rank is None:
            continue
        stamp = str(pod["metadata"].get("creationTimestamp", ""))
        if rank not in ranks or stamp >= str(ranks[rank]["metadata"].get("creationTimestamp", "")):
            ranks[rank] = pod
    return ranks


def logs(handle: str, rank: int | None = None, follow: bool = False, *,
         cluster: Cluster | None = None, out=None) -> int:
    """Print the log of node `rank` (default 0); with `follow`, until the container ends."""
    h = parse_handle(handle)
    cluster = _cluster(cluster)
    out = out or sys.stdout
    rank = 0 if rank is None else rank
    selector = ",".join(f"{k}={v}" for k, v in pod_selector(h.name).items())
    try:
        pods = cluster.pods(h.namespace, selector)
    except ApiError as err:
        raise RuntimeFailure(explain(err, "Pod", h.namespace, selector, "list")) from None
    ranks = pods_by_rank(h.flavor, pods)
    if rank not in ranks:
        have = ", ".join(str(r) for r in sorted(ranks)) or "none yet"
        raise RuntimeFailure(f"{h}: no pod for node rank {rank} (ranks with pods: {have}); "
                             f"see `ddpkit status {h}`")
    pod = ranks[rank]["metadata"]["name"]
    try:
        for chunk in cluster.log(h.namespace, pod, CONTAINER_NAME[h.flavor], follow):
            out.write(chunk)
            out.flush()
    except ApiError as err:
        raise RuntimeFailure(explain(err, "Pod", h.namespace, pod, "read logs of")) from None
    return 0
