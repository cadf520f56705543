"""The Kubernetes cluster seam: job handles, the `Cluster` protocol every verb talks through
(the real one, `KubeCluster`, wraps the `kubernetes` dynamic client: any kind, by apiVersion and
kind, imported only here and only when used, with kubeconfig or in-cluster credentials; the tests
pass a fake), and API errors as one line that names the object and the fix.

Handles are `k8s://NAMESPACE/FLAVOR/NAME`. The verbs are deploy/k8s/submit.py's; the lost-node
labels deploy/k8s/blame.py's; both use this module, which uses neither.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from deploy.errors import RuntimeFailure, UserError
from deploy.k8s import flavor as flavor_module
from deploy.k8s import flavor_of_kind
from deploy.kube import FIELD_MANAGER, FLAVOR_KIND, KUEUE_WORKLOAD_API_VERSION

#: kind -> apiVersion of every kind ddpkit sends.
API_VERSIONS = {"ConfigMap": "v1", "Service": "v1", "Workload": KUEUE_WORKLOAD_API_VERSION,
                **{kind: flavor_module(f).API_VERSION for f, kind in FLAVOR_KIND.items()}}
#: kind -> apiVersion of the kinds ddpkit only reads (and labels: nodes)
READ_API_VERSIONS = {"Pod": "v1", "Event": "v1", "Node": "v1"}


def _group_version(kind: str) -> tuple[str, str]:
    group, _, version = API_VERSIONS.get(kind, "v1").rpartition("/")
    return group, version


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
    def apply(self, obj: dict, *, dry_run: bool) -> dict: ...
    def get(self, kind: str, namespace: str, name: str) -> dict: ...
    def delete(self, kind: str, namespace: str, name: str) -> None: ...
    def pods(self, namespace: str, selector: str) -> list[dict]: ...
    def events(self, namespace: str, pod: str, reason: str) -> list[dict]: ...
    def listed(self, kind: str, namespace: str, selector: str) -> list[dict]: ...
    def log(self, namespace: str, pod: str, container: str, follow: bool,
            tail_lines: int | None = None, previous: bool = False) -> Iterator[str]: ...
    def nodes(self, selector: str) -> list[dict]: ...
    def label_node(self, node: str, key: str, value: str | None) -> None: ...


class KubeCluster:
    """The real cluster through the `kubernetes` dynamic client (kubeconfig, else in-cluster).
    Every call, pods, events, nodes and logs included, goes through the dynamic client and
    answers plain dicts: the typed `CoreV1Api` would import the client's few hundred pydantic
    models (kubernetes 37: about 0.9 CPU-seconds, more than the rest of `ddpkit status`)."""

    def __init__(self) -> None:
        try:
            from kubernetes import client, config
            from kubernetes.dynamic import DynamicClient
            from kubernetes.dynamic.exceptions import ResourceNotFoundError
        except ModuleNotFoundError:
            raise RuntimeFailure("talking to Kubernetes needs the Python package 'kubernetes': "
                                 "pip install 'ddpkit[k8s]'") from None
        load_credentials(config)
        self._client = client
        self._not_served = ResourceNotFoundError
        self.api = client.ApiClient()
        self._dynamic_class = DynamicClient
        self._dynamic = None
        self._resources: dict[str, Any] = {}

    def _call(self, fn, *args, **kwargs) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._client.ApiException as exc:
            raise api_error_from(exc) from None
        except self._not_served:
            raise ApiError(404, "NotFound", "the server does not serve this kind") from None
        except Exception as exc:  # urllib3 connection errors and the like
            if type(exc).__module__.startswith(("urllib3", "socket", "ssl")) or isinstance(exc, OSError):
                host = self.api.configuration.host
                raise ApiError(0, "Unreachable", f"cannot reach the Kubernetes API at {host}") from None
            raise

    def _client_of_kinds(self) -> Any:
        if self._dynamic is None:
            self._dynamic = self._call(self._dynamic_class, self.api)
        return self._dynamic

    def _resource(self, kind: str) -> Any:
        """The dynamic client's resource for `kind` (discovery, once per kind)."""
        if kind not in self._resources:
            api_version = API_VERSIONS.get(kind) or READ_API_VERSIONS[kind]
            self._resources[kind] = self._call(self._client_of_kinds().resources.get,
                                               api_version=api_version, kind=kind)
        return self._resources[kind]

    @staticmethod
    def _dict(value: Any) -> dict:
        return value.to_dict() if hasattr(value, "to_dict") else dict(value or {})

    def apply(self, obj: dict, *, dry_run: bool) -> dict:
        """Server-side apply with field manager `ddpkit` and strict field validation; the
        server answers with the object as stored (or as it would be, on a dry run)."""
        meta = obj["metadata"]
        params: dict[str, Any] = {"field_manager": FIELD_MANAGER,
                                  "query_params": [("fieldValidation", "Strict")]}
        if dry_run:
            params["dry_run"] = "All"
        resource = self._resource(obj["kind"])
        return self._dict(self._call(resource.server_side_apply, body=obj, name=meta["name"],
                                     namespace=meta["namespace"], **params))

    def get(self, kind: str, namespace: str, name: str) -> dict:
        return self._dict(self._call(self._resource(kind).get, name=name, namespace=namespace))

    def delete(self, kind: str, namespace: str, name: str, propagation: str = "Foreground") -> None:
        """Foreground propagation by default: the object stays (with a deletionTimestamp) until
        its dependents (Jobs, pods) are gone; "Background": it goes at once, they after it."""
        self._call(self._resource(kind).delete, name=name, namespace=namespace,
                   body={"propagationPolicy": propagation})

    def pods(self, namespace: str, selector: str) -> list[dict]:
        return self.listed("Pod", namespace, selector)

    def events(self, namespace: str, pod: str, reason: str) -> list[dict]:
        """The pod's events of one `reason` (the kubelet's FailedMount, ...), oldest first."""
        found = self._call(self._resource("Event").get, namespace=namespace,
                           field_selector=f"involvedObject.kind=Pod,involvedObject.name={pod},reason={reason}")
        return self._dict(found).get("items") or []

    def listed(self, kind: str, namespace: str, selector: str) -> list[dict]:
        """The objects of `kind` in `namespace` whose labels match `selector`."""
        found = self._call(self._resource(kind).get, namespace=namespace, label_selector=selector)
        return self._dict(found).get("items") or []

    def nodes(self, selector: str) -> list[dict]:
        found = self._call(self._resource("Node").get, label_selector=selector)
        return self._dict(found).get("items") or []

    def label_node(self, node: str, key: str, value: str | None) -> None:
        """Set the node's label `key` (None: take it off), a merge patch of its labels alone."""
        self._call(self._resource("Node").patch, name=node, body={"metadata": {"labels": {key: value}}},
                   content_type="application/merge-patch+json")

    def log(self, namespace: str, pod: str, container: str, follow: bool,
            tail_lines: int | None = None, previous: bool = False) -> Iterator[str]:
        query = [("container", container), ("follow", str(follow).lower())]
        if tail_lines:
            query.append(("tailLines", str(tail_lines)))
        if previous:  # the container before the kubelet restarted it (kubectl logs --previous)
            query.append(("previous", "true"))
        resp = self._call(self._client_of_kinds().request, "GET", f"/api/v1/namespaces/{namespace}/pods/{pod}/log",
                          query_params=query, header_params={"Accept": "*/*"}, serialize=False)
        import codecs

        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # chunks split characters
        try:
            for chunk in resp.stream(4096):
                yield decoder.decode(chunk)
            yield decoder.decode(b"", final=True)
        finally:
            resp.release_conn()


def kubeconfig_files() -> list[str]:
    """The kubeconfig files that exist: `$KUBECONFIG` (a list, as kubectl reads it), else
    ~/.kube/config."""
    listed = [p for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    return [p for p in listed or [os.path.expanduser("~/.kube/config")] if os.path.isfile(p)]


def load_credentials(config: Any) -> None:
    """The kubeconfig, else the pod's service account. A kubeconfig that exists but cannot be
    used is named with the client's reason (a wrong context, a missing certificate file); only
    when there is none at all, and no service account, is it "no credentials"."""
    files = kubeconfig_files()
    if files:
        try:  # KUBECONFIG read now, not when the client was imported (it caches the variable)
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
        except Exception as exc:  # the client's ConfigException, yaml, OSError: its words, one line
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise RuntimeFailure(f"kubeconfig {os.pathsep.join(files)}: {reason}") from None
        return
    try:
        config.load_incluster_config()
    except config.ConfigException:
        raise RuntimeFailure("no Kubernetes credentials: set KUBECONFIG (or ~/.kube/config) "
                             "or run inside a cluster") from None


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
        module = flavor_of_kind(kind)
        plural = module.PLURAL if module else kind.lower() + "s"
        group = _group_version(kind)[0]
        resource = f"{plural}.{group}" if group else plural
        return (f"{verb} {what}: forbidden (403): you may not {verb} {resource} in namespace "
                f"{namespace}; ask a cluster admin for the RBAC rights")
    if err.status == 404:
        if err.details_kind == "namespaces":
            return f"{verb} {what}: namespace {namespace!r} does not exist; create it or set k8s.namespace"
        module = flavor_of_kind(kind)
        if verb == "create" and module is not None and module.NAME != "job":
            return (f"create {what}: the cluster does not serve {kind} ({module.API_VERSION}); "
                    f"install {module.INSTALLS}, or use --flavor job (needs no operator)")
        return f"{verb} {what}: not found (never submitted, cancelled, or removed after finishing)"
    if err.status == 409:
        return (f"create {what}: already exists; cancel it first (ddpkit cancel "
                f"k8s://{namespace}/<flavor>/{name}) or rename the job")
    if err.status in (400, 422):
        return f"{verb} {what}: the cluster rejected it ({err.status}): {err.message}"
    return f"{verb} {what}: Kubernetes API error {err.status} {err.reason}: {err.message}".rstrip(": ")


def connect(cluster: Cluster | None) -> Cluster:
    """The cluster a verb was given (a test's fake), else the real one."""
    return cluster if cluster is not None else KubeCluster()
