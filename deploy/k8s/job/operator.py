"""What Kubernetes' own Job controller does with the Indexed Job ddpkit renders (there is no
operator and no webhook; the API server's validation of a Job is `deploy.kube.core`): the pods
it makes, and how it restarts them (`deploy.k8s.controller`). `ddpkit run --docker` runs them.
"""

from __future__ import annotations

from deploy.k8s.controller import Pod, Restarts, indexed_job_pods, job_restarts, service_names


def pods(obj: dict, objects: list[dict]) -> list[Pod]:
    """DNS names only through a headless Service of the manifest whose name is the pod
    subdomain and whose selector matches the pod's labels (as cluster DNS)."""
    meta = obj["metadata"]
    namespace = meta.get("namespace", "default")
    found = indexed_job_pods(meta["name"], namespace, obj.get("spec") or {}, first_index=0,
                             labels={}, annotations={}, subdomain=None)
    for p in found:
        if p.subdomain and _headless_service(objects, p.subdomain, namespace, p.labels):
            p.dns_names = service_names(f"{p.hostname}.{p.subdomain}", namespace)
    return found



def _headless_service(objects: list[dict], name: str, namespace: str, labels: dict) -> bool:
    for obj in objects:
        if obj.get("kind") != "Service" or obj["metadata"].get("name") != name:
            continue
        if obj["metadata"].get("namespace", "default") != namespace:
            continue
        spec = obj.get("spec") or {}
        selector = spec.get("selector") or {}
        if spec.get("clusterIP") == "None" and selector and all(
                labels.get(k) == v for k, v in selector.items()):
            return True
    return False



def restarts(obj: dict, objects: list[dict]) -> Restarts:
    """The Job controller's (controller.job_restarts). `run --docker` starts a replacement
    only after the container has exited, which is `podReplacementPolicy: Failed`, the policy
    ddpkit renders; the API default TerminatingOrFailed (a replacement beside the terminating
    pod) is not emulated."""
    return job_restarts(obj.get("spec") or {})
