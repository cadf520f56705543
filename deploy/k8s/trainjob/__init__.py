"""Flavor `trainjob`: a Kubeflow Trainer v2 TrainJob (`trainer.kubeflow.org/v1alpha1`).

The pods come from the ClusterTrainingRuntime `k8s.runtime` (default `torch-distributed`:
replicated job `node`, container `node`); Trainer turns the TrainJob into a JobSet of that name.
What `spec.trainer` cannot say (volumes, /dev/shm, pod metadata, scheduling) goes in
`runtimePatches` (manager `ddpkit.io/render`). The torch plugin gives PET_* (node 0 is
`<name>-node-0-0.<name>:29500`). Restarts: `restarts: N` is torchrun's `--max-restarts N`
inside each pod (DDPKIT_MAX_RESTARTS). The pods' own restarts are the runtime's, and Trainer
v2.3's runtimePatches cannot set a restartPolicy, backoffLimit or failurePolicy:
`torch-distributed` has none, so a failed pod restarts in place (OnFailure, the JobSet
webhook's default) up to 5 times (the Job default backoffLimit 6 is reached by the 6th
restart), also with `restarts: 0` (verified on the testbed). For other semantics, use a
ClusterTrainingRuntime that sets them (`k8s.runtime`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deploy.k8s import pod as podlib
from deploy.k8s.controller import upsert_env
from deploy.problems import Problem
from trainer.contract import DEFAULT_PORT

if TYPE_CHECKING:
    from deploy.spec import JobSpec

NAME = "trainjob"
KIND = "TrainJob"
API_VERSION = "trainer.kubeflow.org/v1alpha1"
GROUP = API_VERSION.rpartition("/")[0]  # "" for the core group
#: Where the object says it is suspended: what Kueue sets while the job waits in its queue
SUSPEND = ("spec", "suspend")
PLURAL = "trainjobs"
INSTALLS = "Kubeflow Trainer (v2) and its ClusterTrainingRuntimes"
#: How `ddpkit cancel` deletes it: in the background, as `kubectl delete` does. Trainer's
#: reconciler (v2.3.0, pkg/controller/trainjob_controller.go) does not skip a TrainJob that is
#: being deleted: under a foreground deletion it applies the JobSet again each time the garbage
#: collector deletes it, and when the collector is the slower of the two (a fresh cluster whose
#: collector has not yet discovered the CRDs, then backs off) the TrainJob never goes: a new
#: JobSet every ~3 s for as long as one watched (the failure TFJob had, kubeflow/trainer#500).
DELETE_PROPAGATION = "Background"
#: ...so `cancel` waits out the JobSet the TrainJob made under its own name (and the pods).
NAMED_CHILD_KINDS: tuple[str, ...] = ("JobSet",)
#: pkg/constants/constants.go: the replicated job and container `node`, ContainerTrainerPort.
NODE = "node"
CONTAINER = NODE
PORT = DEFAULT_PORT  # the torch runtime's PET_MASTER_PORT
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
#: Our entry in spec.runtimePatches (a list-map keyed by manager). Trainer's webhook requires a
#: domain-prefixed path (validation.IsDomainPrefixedPath, pkg/runtime/framework/plugins/jobset/
#: jobset.go:176); the server-side apply field manager stays `ddpkit`.
PATCH_MANAGER = "ddpkit.io/render"
#: What a runtimePatch may set on the pod and its containers (the TrainJob CRD v2.3 schema).
RUNTIME_PATCH_POD_FIELDS = ("affinity", "containers", "imagePullSecrets", "initContainers",
                            "nodeSelector", "schedulingGates", "securityContext",
                            "serviceAccountName", "terminationGracePeriodSeconds", "tolerations",
                            "volumes")
RUNTIME_PATCH_CONTAINER_FIELDS = ("env", "name", "securityContext", "volumeMounts")


def check(job: JobSpec) -> list[Problem]:
    problems = podlib.common_refusals(job, NAME)
    k8s = job.k8s
    # Trainer v2.3 runtimePatches: pod metadata, nodeSelector, tolerations, serviceAccount,
    # imagePullSecrets, terminationGracePeriodSeconds, volumes and container env/mounts.
    for field, value in (("priority_class", k8s.priority_class), ("scheduler_name", k8s.scheduler_name),
                         ("ttl_after_finished", k8s.ttl_after_finished)):
        if value is not None:
            problems.append(Problem(
                f"k8s.{field}", "a TrainJob cannot set it (Trainer v2.3 runtimePatches have no such "
                "field)", f"set it in the ClusterTrainingRuntime {k8s.runtime!r} or use another flavor"))
    if job.image_pull_policy not in (None, "IfNotPresent"):
        problems.append(Problem(
            "image_pull_policy", "a TrainJob cannot set imagePullPolicy",
            "remove it (the runtime's container sets it, else Kubernetes' default for the image "
            "applies) or use another flavor"))
    for field, value in (("host_network", k8s.host_network), ("topology_spread", k8s.topology_spread),
                         ("init_containers", k8s.init_containers), ("sidecars", k8s.sidecars)):
        if value:
            problems.append(Problem(
                f"k8s.{field}", "a TrainJob cannot set it (Trainer v2.3 runtimePatches have no "
                "such field; initContainers there may only patch the runtime's own)",
                f"set it in the ClusterTrainingRuntime {k8s.runtime!r} or use another flavor"))
    spec = k8s.pod_patch.get("spec") or {}
    for key in spec:
        if key not in RUNTIME_PATCH_POD_FIELDS:
            problems.append(Problem(f"k8s.pod_patch.spec.{key}", "a TrainJob's runtimePatches cannot "
                                    f"set it (only {', '.join(RUNTIME_PATCH_POD_FIELDS)})",
                                    "set it in the runtime or use another flavor"))
    for i, c in enumerate([*(spec.get("containers") or []), *(spec.get("initContainers") or [])]):
        for key in c if isinstance(c, dict) else ():
            if key not in RUNTIME_PATCH_CONTAINER_FIELDS:
                problems.append(Problem(f"k8s.pod_patch.spec.containers.{i}.{key}", "a TrainJob's "
                                        "runtimePatches cannot set it (only "
                                        f"{', '.join(RUNTIME_PATCH_CONTAINER_FIELDS)})",
                                        "set it in the runtime or use another flavor"))
    return problems


def master_endpoint(job: JobSpec) -> tuple[str, int]:
    return f"{job.name}-{NODE}-0-0.{job.name}", PORT


def objects(job: JobSpec) -> list[dict]:
    k8s = job.k8s
    env_ = podlib.container_env(job, max_restarts=job.restarts, master=None)
    volumes, mounts = podlib.volumes_and_mounts(job)
    spec: dict = {"runtimeRef": {"name": k8s.runtime}}
    if podlib.deadline(job) is not None:
        spec["activeDeadlineSeconds"] = podlib.deadline(job)
    command = podlib.command(job)
    if podlib.in_configmap(job):  # no init container here: the trainer's unpacks, then runs
        command = podlib.unpack_command(job, command)
        mounts = [*mounts, podlib.WORKDIR_ARCHIVE_MOUNT]
    spec["trainer"] = {"image": podlib.trainer_image(job), "command": command,
                       "numNodes": job.nodes.max, "numProcPerNode": job.nproc_per_node,
                       "resourcesPerNode": podlib.container_resources(job), "env": env_}
    pod_spec: dict = {"terminationGracePeriodSeconds": k8s.termination_grace}
    if k8s.service_account:
        pod_spec["serviceAccountName"] = k8s.service_account
    if k8s.node_selector:
        pod_spec["nodeSelector"] = dict(k8s.node_selector)
    if podlib.tolerations(job):
        pod_spec["tolerations"] = podlib.tolerations(job)
    if k8s.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in k8s.image_pull_secrets]
    if podlib.pod_security(job):
        pod_spec["securityContext"] = podlib.pod_security(job)
    if podlib.affinity(job):
        pod_spec["affinity"] = podlib.affinity(job)
    main: dict = {"name": CONTAINER, "volumeMounts": mounts}
    if podlib.container_security(job):
        main["securityContext"] = podlib.container_security(job)
    pod_spec["containers"] = [main]
    pod_spec["volumes"] = volumes
    template = podlib.apply_pod_patch({"metadata": podlib.pod_metadata(job), "spec": pod_spec},
                                      k8s.pod_patch, CONTAINER)
    # Trainer's webhook refuses env on the `node` container of a runtimePatch ("must not have
    # envs for the ... node containers"): pod_patch's env for it goes to spec.trainer.env,
    # merged by name as a strategic merge of the container would.
    for c in template["spec"]["containers"]:
        if c["name"] == CONTAINER and "env" in c:
            upsert_env(spec["trainer"], c.pop("env"))
    spec["runtimePatches"] = [{"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {
        "replicatedJobs": [{"name": NODE, "template": {"spec": {"template": template}}}]}}}}]
    return [{"apiVersion": API_VERSION, "kind": KIND, "metadata": podlib.workload_metadata(job),
             "spec": spec}]


def state(obj: dict) -> str:
    """TrainJob conditions (trainjob_types.go): Complete, Failed, Suspended; otherwise the
    JobSet's replicated job counts in status.jobsStatus."""
    true = podlib.true_conditions(obj)
    st = obj.get("status") or {}
    if "Complete" in true or "Completed" in true:
        return "SUCCEEDED"
    if "Failed" in true:
        return "FAILED"
    if "Suspended" in true:
        return "PENDING"
    jobs = st.get("jobsStatus") or []
    active = sum(int(j.get("active", 0) or 0) for j in jobs)
    ready = sum(int(j.get("ready", 0) or 0) for j in jobs)
    return "RUNNING" if active or ready else "PENDING"


def node_rank(pod: dict, pods: list[dict]) -> int | None:
    """PET_NODE_RANK is the completion index of the `node` Job."""
    return podlib.completion_index(pod)


