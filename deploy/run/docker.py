"""`ddpkit run JOB --docker [--flavor F]`: the rendered Kubernetes pods, run as Docker containers.

The job is rendered exactly as `ddpkit render k8s` renders it, parsed back as data, and each pod
the controller would create is started as one container on a private Docker network. What the
controllers add to a pod is emulated from the manifest itself (the table of sources is in
`controller_pods`), so a manifest that is wrong for the cluster fails here too:

- names: every pod gets the hostname and the DNS names Kubernetes would give it (a pod's own
  `<pod>` Service for PyTorchJob, `<hostname>.<subdomain>` through a headless Service for
  JobSet, TrainJob and Indexed Jobs, each also with `.<namespace>`, `.svc` and
  `.svc.cluster.local`); a reference to a name Kubernetes would not serve is an error;
- environment: the controller's variables (PET_*, MASTER_*, RANK, WORLD_SIZE,
  JOB_COMPLETION_INDEX), then the container's own list with `valueFrom` and `$(VAR)` resolved;
- volumes: ConfigMaps from the manifest become read-only files; claims, hostPath and NFS become
  directories shared by every pod (as shared storage would be); emptyDirs are per pod, and a
  memory-backed one at /dev/shm sets `--shm-size` to its sizeLimit;
- resources: CPU and memory limits become `--cpus` / `--memory`;
- the image is never pulled: it must be on the daemon (`ddpkit image build`).

Output is streamed with a `[node N]` prefix. A failed pod is restarted as the workload's
controller would (`restart_policy`: the pod alone for PyTorchJob, Job and TrainJob, every pod
for JobSet, as many times as the flavor's `restarts` says the controller allows, per pod for a
Job's backoffLimitPerIndex). The exit code is the job's: 0 when every pod succeeded, else
the code of the pod that failed the job (the others are then stopped). Containers and the
network are removed afterwards, also on Ctrl-C or SIGTERM (pods get SIGTERM and their grace
period).
"""

from __future__ import annotations

import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from deploy import units, workdir
from deploy.errors import UserError
from deploy.image import (
    build_workdir_image,
    docker,
    docker_binary,
    docker_env,
    image_exists,
    require_daemon,
)
from deploy.k8s import operator_of_kind
from deploy.k8s.controller import CLUSTER_DOMAIN, Pod, Restarts
from deploy.k8s.pod import WORKDIR_INIT
from deploy.k8s.pytorchjob import INIT_CONTAINER as PYTORCHJOB_INIT_CONTAINER
from deploy.kube import FLAVOR_KIND, gpu_vendor
from trainer.contract import EXIT_STOPPED, LAUNCH_T0_VAR, WORKDIR_HASH_VAR

#: Label on every container and network this module creates (for manual clean-up:
#: `docker rm -f $(docker ps -aq --filter label=ddpkit.run)`).
RUN_LABEL = "ddpkit.run"


def controller_pods(objects: list[dict]) -> list[Pod]:
    """Every pod the workload object among `objects` would get, in node-rank order: the
    flavor of its kind says what its controller makes of it (deploy/k8s/<flavor>/operator.py,
    `pods`, with the upstream sources cited there)."""
    workloads = [o for o in objects if o.get("kind") in FLAVOR_KIND.values()]
    if len(workloads) != 1:
        raise UserError(f"the rendered manifest has {len(workloads)} workload objects; "
                        "--docker runs exactly one (PyTorchJob, TrainJob, JobSet or Job)")
    obj = workloads[0]
    return sorted(operator_of_kind(obj["kind"]).pods(obj, objects), key=lambda p: p.index)


def restart_policy(objects: list[dict]) -> Restarts:
    """What the workload's controller does after a pod fails (the flavor's `restarts`)."""
    for obj in objects:
        module = operator_of_kind(obj.get("kind", ""))
        if module is not None:
            return module.restarts(obj, objects)
    return Restarts()


# --------------------------------------------------------------------------------------------
# Pod spec -> docker arguments


_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion (`$$` escapes; unknown references stay as written)."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR_REF.sub(sub, text)


def _field_value(pod: Pod, path: str) -> str:
    simple = {"metadata.name": pod.name, "metadata.namespace": pod.namespace,
              "spec.serviceAccountName": pod.spec.get("serviceAccountName", "default"),
              "spec.nodeName": "docker", "metadata.uid": f"docker-{pod.name}"}
    if path in simple:
        return simple[path]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        source = pod.labels if m.group(1) == "labels" else pod.annotations
        return source.get(m.group(2), "")
    raise UserError(f"pod {pod.name}: env fieldRef {path!r} is not supported by --docker")


def resolve_env(pod: Pod, container: dict, objects: list[dict], host_env: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet would set it: its env list (the
    controller's variables already in it, where the controller puts them) in order, a later
    entry of the same name winning, each value `$(VAR)`-expanded against those before it."""
    env: dict[str, str] = _env_from(pod, container, objects)
    for item in container.get("env") or []:
        name = item["name"]
        if "value" in item:
            env[name] = expand(str(item["value"]), env)
            continue
        source = item.get("valueFrom") or {}
        if "fieldRef" in source:
            env[name] = _field_value(pod, source["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            if name in host_env:
                env[name] = host_env[name]
            elif not ref.get("optional"):
                raise UserError(f"env {name}: comes from Secret {ref.get('name')!r} (key "
                                f"{ref.get('key')!r}), which --docker cannot read; export "
                                f"{name} on this host to pass it in")
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            data = _configmap_data(objects, ref["name"], pod.namespace)
            if data is not None and ref["key"] in data:
                env[name] = data[ref["key"]]
            elif not ref.get("optional"):
                raise UserError(f"env {name}: ConfigMap {ref['name']!r} key {ref['key']!r} is "
                                "not in the manifest; the pod would not start")
        else:
            raise UserError(f"env {name}: valueFrom {sorted(source)} is not supported by --docker")
    return env


def _env_from(pod: Pod, container: dict, objects: list[dict]) -> dict[str, str]:
    """envFrom, read before env (env wins): a ConfigMap of the manifest, each key with the
    entry's prefix. A Secret's keys cannot be read here: refused unless optional."""
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            ref = source["configMapRef"]
            data = _configmap_data(objects, ref["name"], pod.namespace)
            if data is None and not ref.get("optional"):
                raise UserError(f"pod {pod.name}: envFrom ConfigMap {ref['name']!r} is not in the manifest; "
                                "the pod would not start")
            env.update({prefix + k: v for k, v in (data or {}).items()})
        elif "secretRef" in source:
            if not source["secretRef"].get("optional"):
                raise UserError(f"pod {pod.name}: envFrom Secret {source['secretRef'].get('name')!r}: --docker "
                                "cannot read Secrets; name each variable under env with secretKeyRef and "
                                "export it on this host")
        else:
            raise UserError(f"pod {pod.name}: envFrom {sorted(source)} is not supported by --docker")
    return env


def _configmap_data(objects: list[dict], name: str, namespace: str) -> dict[str, str | bytes] | None:
    """A ConfigMap's keys: `data` as text, `binaryData` as the bytes its base64 stands for."""
    import base64

    for obj in objects:
        if (obj.get("kind") == "ConfigMap" and obj["metadata"].get("name") == name
                and obj["metadata"].get("namespace", "default") == namespace):
            out: dict[str, str | bytes] = {k: str(v) for k, v in (obj.get("data") or {}).items()}
            out.update({k: base64.b64decode(str(v)) for k, v in (obj.get("binaryData") or {}).items()})
            return out
    return None


def _cpus(quantity: object) -> str:
    """`--cpus` for a CPU limit, capped at this machine's CPU count (docker refuses more; the
    cap is a local limit, not one of the manifest)."""
    cpus = float(units.quantity(quantity))
    return f"{min(cpus, os.cpu_count() or 1):g}"


@dataclass
class Mount:
    source: Path | None      # None: tmpfs
    target: str
    read_only: bool = False
    size: int | None = None  # tmpfs bytes
    files: dict[str, tuple[str | bytes, int]] | None = None  # ConfigMap: relative path -> (content, mode)


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "_"


def pod_mounts(pod: Pod, container: dict, objects: list[dict], run_dir: Path) -> tuple[list[Mount], int | None]:
    """The container's volume mounts as local directories, and the /dev/shm size if the pod
    mounts a memory-backed emptyDir there."""
    volumes = {v["name"]: v for v in pod.spec.get("volumes") or []}
    limits = (container.get("resources") or {}).get("limits") or {}
    mounts: list[Mount] = []
    shm_size: int | None = None
    for vm in container.get("volumeMounts") or []:
        vol = volumes.get(vm["name"])
        target = vm["mountPath"]
        if vol is None:
            raise UserError(f"pod {pod.name}: volumeMount {vm['name']!r} names no volume of the pod")
        if ":" in target or "," in target:
            raise UserError(f"pod {pod.name}: mountPath {target!r}: ':' and ',' are not supported by --docker")
        read_only = bool(vm.get("readOnly"))
        if "emptyDir" in vol:
            empty = vol["emptyDir"] or {}
            size = units.parse_quantity(empty["sizeLimit"]) if empty.get("sizeLimit") else None
            if empty.get("medium") == "Memory":
                if size is None and limits.get("memory"):
                    size = units.parse_quantity(limits["memory"])  # tmpfs counts against the pod
                if target == "/dev/shm":
                    shm_size = size or 64 * 2**20
                else:
                    mounts.append(Mount(None, target, read_only, size))
                continue
            source = run_dir / "pods" / pod.name / _safe_name(vm["name"])
        elif "configMap" in vol:
            files = _configmap_files(vol["configMap"], pod, objects)
            source = run_dir / "configmaps" / _safe_name(vol["configMap"]["name"])
            mounts.append(Mount(source, target, True, files=files))  # always read-only
            continue
        elif "persistentVolumeClaim" in vol:
            claim = vol["persistentVolumeClaim"]
            source = run_dir / "volumes" / f"claim-{_safe_name(claim['claimName'])}"
            read_only = read_only or bool(claim.get("readOnly"))
        elif "hostPath" in vol:
            source = run_dir / "volumes" / f"host{_safe_name(vol['hostPath']['path'])}"
        elif "nfs" in vol:
            nfs = vol["nfs"]
            source = run_dir / "volumes" / f"nfs-{_safe_name(nfs['server'])}{_safe_name(nfs['path'])}"
            read_only = read_only or bool(nfs.get("readOnly"))
        else:
            kinds = sorted(set(vol) - {"name"})
            raise UserError(f"pod {pod.name}: volume {vm['name']!r} of type {kinds} is not "
                            "supported by --docker (configMap, emptyDir, persistentVolumeClaim, "
                            "hostPath and nfs are)")
        if vm.get("subPath"):
            source = source / vm["subPath"]
        mounts.append(Mount(source, target, read_only))
    return mounts, shm_size


def _configmap_files(ref: dict, pod: Pod, objects: list[dict]) -> dict[str, tuple[str | bytes, int]]:
    data = _configmap_data(objects, ref["name"], pod.namespace)
    if data is None:
        raise UserError(f"pod {pod.name}: ConfigMap {ref['name']!r} is not in the manifest; the "
                        "pod would stay in ContainerCreating on a cluster")
    files = {}
    for item in ref.get("items") or [{"key": k, "path": k} for k in data]:
        if item["key"] not in data:
            raise UserError(f"pod {pod.name}: ConfigMap {ref['name']!r} has no key {item['key']!r}")
        files[item["path"]] = (data[item["key"]], item.get("mode", ref.get("defaultMode", 0o644)))
    return files


def prepare_mounts(plans: list[ContainerPlan]) -> None:
    """Create the local side of every mount, once all checks passed: ConfigMap files (written
    anew), and directories every container user can write (the image runs as uid 1000)."""
    for plan in plans:
        for m in plan.mounts:
            if m.source is None:
                continue
            if m.files is not None:
                if m.source.exists():
                    shutil.rmtree(m.source)
                for rel, (content, mode) in m.files.items():
                    path = m.source / rel
                    path.parent.mkdir(parents=True, exist_ok=True)
                    if isinstance(content, bytes):
                        path.write_bytes(content)
                    else:
                        path.write_text(content, encoding="utf-8")
                    path.chmod(mode)
                m.source.chmod(0o755)
            else:
                m.source.mkdir(parents=True, exist_ok=True)
                m.source.chmod(0o777)


def unserved_names(pods: list[Pod]) -> dict[str, str]:
    """Names of pods that cluster DNS would not resolve, each with the reason: a bare hostname
    (Docker's DNS would resolve it, so it must be caught here), and `<hostname>.<subdomain>`
    when no headless Service gives the pod that name."""
    served = {n for p in pods for n in p.dns_names}
    names = {}
    for p in pods:
        if p.hostname not in served:
            names[p.hostname] = (f"a bare pod hostname, which Kubernetes DNS does not resolve"
                                 f"{f' (it serves {p.dns_names[0]})' if p.dns_names else ''}")
        if p.subdomain and not p.dns_names:
            names[f"{p.hostname}.{p.subdomain}"] = (
                f"not resolvable: no headless Service named {p.subdomain!r} in the manifest "
                "selects the pod")
    return names


def check_names(pods: list[Pod], envs: dict[str, dict[str, str]], argvs: dict[str, list[str]]) -> None:
    """Fail on a reference to a peer that cluster DNS would not resolve: on a cluster it would
    hang the rendezvous until its timeout."""
    for host, reason in unserved_names(pods).items():
        token = re.compile(rf"(?<![\w.-]){re.escape(host)}(?![\w-]|\.[a-z0-9])")
        for pod in pods:
            for key, value in envs[pod.name].items():
                if token.search(value):
                    raise UserError(f"pod {pod.name}: env {key}={value!r} names {host}: {reason}")
            for arg in argvs[pod.name]:
                if token.search(arg):
                    raise UserError(f"pod {pod.name}: command argument {arg!r} names {host}: {reason}")


@dataclass
class ContainerPlan:
    pod: Pod
    container_name: str      # docker's name
    image: str
    create_args: list[str]   # `docker create` arguments (before the image)
    argv: list[str]          # entrypoint override + args (k8s command/args)
    mounts: list[Mount] = field(default_factory=list)
    unpack: list[str] | None = None  # the workdir's init container, as this host runs it


def plan_containers(pods: list[Pod], objects: list[dict], run_dir: Path, run_id: str,
                    network: str, host_env: dict[str, str], extra_env: dict[str, str]) -> list[ContainerPlan]:
    """`docker create` arguments for each pod's (single) container. Checks everything and
    writes nothing (`prepare_mounts` does, once the run is sure to start)."""
    plans, envs, argvs = [], {}, {}
    first_gpu = 0  # pods on one host: each gets its own GPUs, as a node's device plugin would
    for pod in pods:
        containers = pod.spec.get("containers") or []
        if len(containers) != 1:
            raise UserError(f"pod {pod.name}: {len(containers)} containers; --docker runs pods "
                            "with exactly one")
        # the training operator's init container only waits until the Master's DNS name
        # resolves; Docker's names exist before any container starts
        inits = [c for c in pod.spec.get("initContainers") or []
                 if c.get("name") not in (PYTORCHJOB_INIT_CONTAINER, WORKDIR_INIT)]
        if inits:
            raise UserError(f"pod {pod.name}: init containers and sidecars "
                            f"({', '.join(c['name'] for c in inits)}) are not supported by --docker")
        container = containers[0]
        env = resolve_env(pod, container, objects, host_env)
        env.update(extra_env)
        command = [expand(str(a), env) for a in container.get("command") or []]
        args = [expand(str(a), env) for a in container.get("args") or []]
        envs[pod.name], argvs[pod.name] = env, command + args
        mounts, shm = pod_mounts(pod, container, objects, run_dir)
        cname = f"ddpkit-{run_id}-{pod.name}"
        create = ["--name", cname, "--hostname", pod.hostname, "--network", network,
                  "--label", f"{RUN_LABEL}={run_id}", "--init", "--pull", "never",
                  "--stop-timeout", str(int(pod.spec.get("terminationGracePeriodSeconds", 30)))]
        for alias in pod.dns_names:
            create += ["--network-alias", alias]
        if pod.subdomain:
            create += ["--domainname", f"{pod.subdomain}.{pod.namespace}.svc.{CLUSTER_DOMAIN}"]
        for key, value in env.items():
            create += ["--env", f"{key}={value}"]
        create += _mount_args(mounts, shm) + _limit_args(pod, container)
        gpu_args, first_gpu = _gpu_args(container, first_gpu)
        create += gpu_args
        if command:
            create += ["--entrypoint", command[0]]
        argv = command[1:] + args if command else args
        unpack, init_mounts = None, []
        for init in pod.spec.get("initContainers") or []:
            if init.get("name") == WORKDIR_INIT:  # its mounts are made too, not mounted here
                unpack, init_mounts = _on_host(pod, init, objects, run_dir)
        plans.append(ContainerPlan(pod, cname, container["image"], create, argv,
                                   mounts + [m for m in init_mounts if m not in mounts], unpack))
    check_names(pods, envs, argvs)
    return plans


def _on_host(pod: Pod, init: dict, objects: list[dict], run_dir: Path) -> tuple[list[str], list[Mount]]:
    """ddpkit's workdir init container (deploy/k8s/pod.py `workdir_init`) as an argv for this
    host: its own python code (the standard library's tarfile) with this interpreter, its paths
    those of the mounts' local sides: it unpacks the ConfigMap's archive into the pod's
    emptyDir before the pod's container starts, as the kubelet would run it."""
    mounts, _ = pod_mounts(pod, init, objects, run_dir)
    argv = [sys.executable]
    for arg in (init.get("command") or [])[1:] + (init.get("args") or []):
        for m in sorted(mounts, key=lambda m: -len(m.target)):
            if m.source is not None and (arg == m.target or arg.startswith(m.target.rstrip("/") + "/")):
                arg = str(m.source.resolve()) + arg[len(m.target.rstrip("/")):]
                break
        argv.append(arg)
    return argv, mounts


def unpack_workdirs(plans: list[ContainerPlan], out) -> None:
    """Run each pod's workdir init container (on this host) once its mounts exist."""
    for plan in plans:
        if plan.unpack is not None:
            proc = subprocess.run(plan.unpack, capture_output=True, text=True, timeout=600,
                                  env={**os.environ, **_init_env(plan)})
            for line in (proc.stdout + proc.stderr).splitlines():
                out.write(f"{plan.pod.prefix}{line}\n")
            if proc.returncode != 0:
                raise UserError(f"pod {plan.pod.name}: init container {WORKDIR_INIT} failed "
                                f"(exit {proc.returncode}); the pod would never start")


def _init_env(plan: ContainerPlan) -> dict[str, str]:
    env = {}
    for i, arg in enumerate(plan.create_args):
        if arg == "--env" and plan.create_args[i + 1].startswith(WORKDIR_HASH_VAR + "="):
            key, _, value = plan.create_args[i + 1].partition("=")
            env[key] = value
    return env


def _mount_args(mounts: list[Mount], shm: int | None) -> list[str]:
    """Volumes as tmpfs (emptyDir) or bind mounts, and the memory-backed /dev/shm's size."""
    create: list[str] = []
    for m in mounts:
        if m.source is None:
            opts = f"rw,size={m.size}" if m.size else "rw"
            create += ["--tmpfs", f"{m.target}:{opts},mode=1777"]
        else:
            create += ["--volume", f"{m.source.resolve()}:{m.target}{':ro' if m.read_only else ''}"]
    if shm:
        create += ["--shm-size", str(shm)]
    return create


def _gpu_args(container: dict, first: int) -> tuple[list[str], int]:
    """The container's GPUs: host devices `first`.. `first`+N-1 (`--gpus N` would give every
    container devices 0..N-1, so two pods on one host would share them), and the next free one.
    NVIDIA through the NVIDIA runtime (`--gpus "device=0,1"`: quoted, the list is CSV); AMD's
    ROCm containers get /dev/kfd and /dev/dri (and the video group) and see their share through
    ROCR_VISIBLE_DEVICES."""
    limits = (container.get("resources") or {}).get("limits") or {}
    wanted = [(gpu_vendor(k), int(v)) for k, v in limits.items() if gpu_vendor(k)]  # MIG and shared names too
    if not wanted:
        return [], first
    vendor, count = wanted[0]
    devices = ",".join(str(i) for i in range(first, first + count))
    if vendor == "amd":
        args = ["--device", "/dev/kfd", "--device", "/dev/dri", "--group-add", "video",
                "--env", f"ROCR_VISIBLE_DEVICES={devices}"]
    else:
        args = ["--gpus", f'"device={devices}"']
    return args, first + count


def _limit_args(pod: Pod, container: dict) -> list[str]:
    """The container's limits, capabilities, user and group, and working directory."""
    create: list[str] = []
    limits = (container.get("resources") or {}).get("limits") or {}
    if limits.get("cpu"):
        create += ["--cpus", _cpus(limits["cpu"])]
    if limits.get("memory"):
        create += ["--memory", str(units.parse_quantity(limits["memory"]))]
    if pod.spec.get("hostNetwork"):
        raise UserError(f"pod {pod.name}: hostNetwork is not supported by --docker (the pods "
                        "share a private Docker network); run without k8s.host_network")
    for cap in ((container.get("securityContext") or {}).get("capabilities") or {}).get("add") or []:
        create += ["--cap-add", str(cap)]
    sc = {**(pod.spec.get("securityContext") or {}), **(container.get("securityContext") or {})}
    if sc.get("runAsUser") is not None:
        create += ["--user", f"{sc['runAsUser']}:{sc.get('runAsGroup', sc['runAsUser'])}"]
    if pod.spec.get("securityContext", {}).get("fsGroup") is not None:
        create += ["--group-add", str(pod.spec["securityContext"]["fsGroup"])]
    if container.get("workingDir"):
        create += ["--workdir", container["workingDir"]]
    return create


# --------------------------------------------------------------------------------------------
# Running


class _Stop(Exception):
    """SIGTERM to ddpkit: stop the pods like Ctrl-C."""


class DockerRun:
    """Containers of one run: create, start, stream, restart per the workload's policy, and
    always clean up."""

    def __init__(self, plans: list[ContainerPlan], network: str, run_id: str,
                 restarts: Restarts | None = None, out=None):
        self.plans, self.network, self.run_id = plans, network, run_id
        self.restarts = restarts or Restarts()
        self.out = out or sys.stdout
        self.lock = threading.Lock()
        self.ended: queue.Queue[tuple[ContainerPlan, int, str]] = queue.Queue()
        self.summary: dict | None = None

    def _print(self, line: str) -> None:
        with self.lock:
            self.out.write(line)
            self.out.flush()

    def _attach(self, plan: ContainerPlan) -> None:
        """`docker start --attach`: stream the output with the node prefix; its exit code is the
        container's. Reports (plan, exit code) when the container ends."""
        prefix = plan.pod.prefix
        proc = subprocess.Popen([docker_binary(), "start", "--attach", plan.container_name],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=docker_env(), start_new_session=True)
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace")
            if line.startswith("ddpkit-summary "):
                try:
                    self.summary = json.loads(line[len("ddpkit-summary "):])
                except json.JSONDecodeError:
                    pass
            self._print(prefix + line if line.endswith("\n") else prefix + line + "\n")
        rc = proc.wait()
        error = ""
        if rc != 0:  # did the container run at all? (a GPU request on a host without GPUs...)
            error = docker("inspect", "--format", "{{.State.Error}}", plan.container_name,
                           check=False, timeout=60).stdout.strip()
        self.ended.put((plan, rc, error))

    def _start(self, plan: ContainerPlan) -> None:
        threading.Thread(target=self._attach, args=(plan,), daemon=True).start()

    def run(self) -> int:
        docker("network", "create", "--label", f"{RUN_LABEL}={self.run_id}", self.network)
        try:
            for plan in self.plans:
                docker("create", *plan.create_args, plan.image, *plan.argv)
            return self._supervise()
        finally:
            # a second Ctrl-C must not leave containers behind: finish the clean-up first
            previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                self._stop()
                self.cleanup()
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    def _supervise(self) -> int:
        """Wait for every pod; restart failed ones as the workload's controller would; return 0
        when all succeeded, else the exit code of the pod that failed the job."""
        policy, used, per_pod = self.restarts, 0, {}
        running, done = self._start_ready(set(), set())
        while running:
            plan, rc, error = self.ended.get()
            running.discard(plan.container_name)
            if rc == 0:
                done.add(plan.container_name)
                running |= self._start_ready(running, done)[0]
                continue
            if error:  # on a cluster the pod would never start either: no restart helps
                self._print(f"ddpkit: pod {plan.pod.name} could not start: {error}; stopping "
                            "the others\n")
                return 1
            count = per_pod.get(plan.pod.name, 0) if policy.per_pod else used
            if policy.allows(rc, count):
                used += 1
                per_pod[plan.pod.name] = per_pod.get(plan.pod.name, 0) + 1
                what = "restarting it" if policy.scope == "pod" else "restarting every pod"
                self._print(f"ddpkit: pod {plan.pod.name} exited with {rc}; {what} "
                            f"({count + 1}/{'no limit' if policy.limit is None else policy.limit}, "
                            f"{policy.source})\n")
                if policy.scope == "gang":
                    self._stop()
                    for _ in range(len(running)):
                        self.ended.get()
                    running, done = self._start_ready(set(), set())
                else:
                    running.add(plan.container_name)
                    self._start(plan)
                continue
            left = f" after {used} restart(s)" if used else ""
            self._print(f"ddpkit: pod {plan.pod.name} failed with exit code {rc}{left}; "
                        "the job failed; stopping the others\n")
            return rc
        waiting = [p.pod.name for p in self.plans if p.container_name not in done]
        if waiting:  # a dependency that can never be met (not reachable through the checks)
            self._print(f"ddpkit: pods {', '.join(waiting)} never started: their dependsOn was not met\n")
            return 1
        return 0

    def _start_ready(self, running: set[str], done: set[str]) -> tuple[set[str], set[str]]:
        """Start every pod not yet started whose dependsOn is met (controller.Pod.depends_on,
        JobSet's dependencyReachedStatus): `Complete`: every pod of that group exited 0;
        `Ready`: every one started (a container without probes is Ready once running).
        Repeats until nothing more starts (a Ready chain starts at once). Returns the started
        set (running) and `done`."""
        started = set(running) | set(done)
        while True:
            ready = [p for p in self.plans if p.container_name not in started
                     and all(self._reached(group, status, started, done) for group, status in p.pod.depends_on)]
            if not ready:
                return started - done, done
            for plan in ready:
                started.add(plan.container_name)
                self._start(plan)

    def _reached(self, group: str, status: str, started: set[str], done: set[str]) -> bool:
        names = {p.container_name for p in self.plans if p.pod.group == group}
        return names <= (done if status == "Complete" else started)

    def _stop(self) -> None:
        """SIGTERM, then SIGKILL after each pod's grace period (`docker stop`), all at once."""
        names = [p.container_name for p in self.plans]
        grace = max(int(p.pod.spec.get("terminationGracePeriodSeconds", 30)) for p in self.plans)
        docker("stop", "--time", str(grace), *names, check=False, timeout=grace + 60)

    def cleanup(self, attempts: int = 10) -> None:
        """Remove this run's containers and network, retrying: a busy daemon sometimes refuses
        a removal (a container still being torn down); say so if anything is left."""
        label = f"label={RUN_LABEL}={self.run_id}"
        error = ""
        for attempt in range(attempts):
            listed = docker("ps", "--all", "--quiet", "--filter", label, check=False, timeout=60)
            left = listed.stdout.split()
            if left:
                error = docker("rm", "--force", *left, check=False, timeout=120).stderr.strip()
            nets = docker("network", "ls", "--quiet", "--filter", label, check=False, timeout=60)
            networks = nets.stdout.split()
            if networks:
                error = docker("network", "rm", *networks, check=False, timeout=60).stderr.strip() or error
            if listed.returncode or nets.returncode:  # a failed listing proves nothing is left
                error = (listed.stderr or nets.stderr).strip() or error
            elif not left and not networks:
                return
            time.sleep(min(0.5 * (attempt + 1), 3))
        self._print(f"ddpkit: could not remove every container of this run ({error}); remove them "
                    f"with: docker rm -f $(docker ps -aq --filter {label}) && docker network rm "
                    f"{self.network}\n")


def default_run_dir(job, flavor: str) -> Path:
    return Path(job.train.output_dir) / f"{job.name}-docker-{flavor}"


def run_docker(job, source: str, *, flavor: str | None = None, run_dir: Path | None = None,
               host_env: dict[str, str] | None = None) -> int:
    """Render `job` for Kubernetes and run its pods as containers; return the job's exit code."""
    from deploy.k8s.render import parse_objects, render_k8s

    flavor = flavor or job.k8s.flavor
    objects = parse_objects(render_k8s(job, flavor=flavor, source=source))
    pods = controller_pods(objects)
    require_daemon()
    run_dir = Path(run_dir or default_run_dir(job, flavor))
    run_id = secrets.token_hex(3)
    network = f"ddpkit-{job.name}-{run_id}"
    t0 = time.time()
    plans = plan_containers(pods, objects, run_dir, run_id, network,
                            host_env if host_env is not None else dict(os.environ),
                            {LAUNCH_T0_VAR: repr(t0)})
    tag = workdir.image_of(job)
    if tag:  # the tree as a thin image layer, as `submit` builds it (pushed nowhere: this daemon runs it)
        built = build_workdir_image(job.image, workdir.snapshot(job), tag)
        print(f"ddpkit: workdir image {tag}: built in {built:.1f}s", file=sys.stderr, flush=True)
    for image in sorted({p.image for p in plans}):
        if not image_exists(image):
            raise UserError(f"image {image}: not on this Docker daemon and --docker never pulls; "
                            f"build it with `ddpkit image build --tag {image}`")
    if (run_dir / "pods").exists():
        shutil.rmtree(run_dir / "pods")  # emptyDirs live as long as their pod
    prepare_mounts(plans)
    unpack_workdirs(plans, sys.stderr)
    print(f"ddpkit: running {job.name} ({source}) as {len(plans)} {flavor} pod(s) in Docker "
          f"(network {network}; volumes in {run_dir})", file=sys.stderr, flush=True)
    runner = DockerRun(plans, network, run_id, restart_policy(objects))

    def on_term(signum, frame):
        raise _Stop()

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        rc = runner.run()
    except _Stop:
        print("ddpkit: stopped (SIGTERM); containers removed", file=sys.stderr)
        return EXIT_STOPPED
    except KeyboardInterrupt:
        print("ddpkit: interrupted; containers removed", file=sys.stderr)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    if runner.summary is not None:
        from deploy.run.local import format_summary

        print(f"\n{job.name}: {runner.summary.get('status')} ({flavor} in Docker)\n"
              f"{format_summary(runner.summary)}", flush=True)
    return rc
