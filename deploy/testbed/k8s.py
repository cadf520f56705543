"""`ddpkit testbed k8s up|down|status|env`: a real N-node Kubernetes cluster (default 2) on this machine.

The Go binaries come from `k8s/testbed/build.sh` (compiled once from the upstream Go modules,
cached by version in /var/cache/ddpkit/k8s); `k8s/testbed/cluster.sh` starts them as host
processes (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, containerd, kubelet,
CoreDNS, training-operator, JobSet, Trainer). This module installs Debian's runc, CNI plugins,
iptables and busybox when missing, builds the binaries when the cache lacks them, runs the
script, and holds the two steps the script hands to Python:

- `_images`: the sandbox ("pause") image, made from the static `pause` binary compiled from the
  Kubernetes release's own build/pause/linux/pause.c, and a busybox image (Debian's
  busybox-static) for training-operator's PyTorchJob init container, both written as
  docker-archive tarballs here and imported into containerd (no registry anywhere).
- `_manifests`: the controllers' CRDs, RBAC and webhook configurations rendered with
  `kubectl kustomize` from their own upstream kustomizations, changed only where a host process
  needs it: Deployments and Services dropped, each webhook's `service` reference replaced by a
  `url` on loopback (plus our CA as caBundle for JobSet and Trainer; training-operator's own
  cert rotator injects its CA).

`load_image(tag)` imports an image from the Docker engine (`docker save`) into the cluster's
containerd, like `kind load docker-image`; `up` does it for ddpkit's default training image when
Docker has it. Needs root.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from decimal import Decimal
from pathlib import Path

from deploy.errors import RuntimeFailure, UserError
from deploy.testbed import apt_install, run_action

_PACKAGE_DIR = Path(__file__).resolve().parent.parent
PACKAGES = ["runc", "containernetworking-plugins", "iptables", "busybox-static", "curl", "openssl"]
# files those packages provide that the testbed uses
NEEDED_FILES = ["/usr/sbin/runc", "/usr/lib/cni/bridge", "/usr/lib/cni/host-local",
                "/usr/lib/cni/loopback", "/bin/busybox"]
NEEDED_COMMANDS = ["iptables", "curl", "openssl"]
PAUSE_IMAGE = "ddpkit-pause:3.10"
BUSYBOX_IMAGE = "ddpkit-busybox:3"
#: images imported from Docker by `up` when Docker has them (ddpkit's default training image)
DEFAULT_IMAGES = ["ddpkit:0.1"]
#: the kubelets' node names are NODE_PREFIX + its index (k8s/testbed/cluster.sh `node_name`)
NODE_PREFIX = "ddpkit-k8s-node-"
WEBHOOK_HOST = {
    # (service namespace, service name) -> (host, port, our CA as caBundle?)
    ("kubeflow", "training-operator"): ("training-operator.kubeflow.svc", 19443, False),
    ("jobset-system", "jobset-webhook-service"): ("127.0.0.1", 19444, True),
    ("kubeflow-system", "kubeflow-trainer-controller-manager"): ("127.0.0.1", 19445, True),
    ("kueue-system", "kueue-webhook-service"): ("127.0.0.1", 19446, True),
}
#: upstream kustomization per controller: (component, path inside its manifests copy)
KUSTOMIZATIONS = [
    ("training-operator", "manifests/overlays/standalone"),
    ("jobset", "config/default"),
    ("trainer", "manifests/overlays/manager"),
]
DROP_KINDS = {"Deployment", "Service"}
#: Kueue (`cluster.sh kueue`): its integrations the testbed turns on (the Configuration's
#: integrations.frameworks, k8s/testbed/cluster.sh) and the resource each one's webhooks watch.
#: The webhooks of every other integration are dropped: Kueue answers them with a no-op while it
#: runs, but they are failurePolicy Fail, so while it is down they would refuse every pod.
KUEUE_FRAMEWORKS = {"batch/job": "jobs", "kubeflow.org/pytorchjob": "pytorchjobs",
                    "jobset.x-k8s.io/jobset": "jobsets", "trainer.kubeflow.org/trainjob": "trainjobs"}
KUEUE_GROUP = "kueue.x-k8s.io"
#: The testbed's queue: one ResourceFlavor, a ClusterQueue sized to the nodes' allocatable CPU,
#: memory and GPUs (preempting lower priorities), and a LocalQueue of that name in `default`.
KUEUE_QUEUE = "ddpkit"
KUEUE_FLAVOR = "testbed"


def scripts_dir() -> Path:
    for candidate in (_PACKAGE_DIR / "_templates" / "k8s" / "testbed",
                      _PACKAGE_DIR.parent / "k8s" / "testbed"):
        if (candidate / "cluster.sh").is_file():
            return candidate
    raise RuntimeFailure("k8s/testbed/cluster.sh is missing; reinstall ddpkit")


def cache_dir() -> Path:
    return Path(os.environ.get("DDPKIT_K8S_CACHE", "/var/cache/ddpkit/k8s"))


def bin_dir() -> Path:
    return cache_dir() / "bin"


def testbed_dir() -> Path:
    return Path(os.environ.get("DDPKIT_K8S_TESTBED_DIR", "/var/lib/ddpkit-k8s-testbed"))


def kubeconfig() -> Path:
    return testbed_dir() / "kubeconfig" / "admin.kubeconfig"


def kubectl() -> str:
    return str(bin_dir() / "kubectl")


def client_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with KUBECONFIG set and the testbed's kubectl first."""
    env = dict(os.environ if env is None else env)
    env["KUBECONFIG"] = str(kubeconfig())
    env["PATH"] = f"{bin_dir()}{os.pathsep}{env.get('PATH', '')}"
    return env


def _require_root() -> None:
    if os.geteuid() != 0:
        raise UserError("ddpkit testbed k8s needs root (network, cgroups, daemons): run it with sudo")


def ensure_packages() -> None:
    missing = [f for f in NEEDED_FILES if not Path(f).exists()]
    missing += [c for c in NEEDED_COMMANDS if shutil.which(c) is None]
    if missing:
        apt_install(PACKAGES)


#: build.sh's binaries: the cluster's, and each extra's (built after them, on request)
CLUSTER_BINARIES = ("kube-apiserver", "kubelet", "kubectl", "etcd", "containerd", "coredns",
                    "training-operator.v1", "jobset", "trainer-controller-manager", "pause")
EXTRA_BINARIES = {"kueue": "kueue", "kwok": "kwok"}


def ensure_binaries(*extras: str) -> None:
    """Build the cluster's Go binaries, and the `extras` ("kueue", "kwok"), unless build.sh's
    cache already has them. From a source checkout with Go on PATH build.sh always runs: it
    returns at once when every component asked for is cached, and when another build.sh is
    compiling (CI starts one in the background) it waits for that one's phase it needs: the
    cluster's components, or also its extras."""
    needed = [*CLUSTER_BINARIES, *(EXTRA_BINARIES[x] for x in extras)]
    have = all((bin_dir() / b).exists() for b in needed) and (cache_dir() / "manifests").is_dir()
    build = scripts_dir() / "build.sh"  # not in the wheel: the binaries are built from a checkout
    if shutil.which("go") is None or not build.is_file():
        if have:
            return
        raise RuntimeFailure(f"the Kubernetes binaries are not in {bin_dir()}: build them from a "
                             "ddpkit checkout with Go >= 1.26 (bash k8s/testbed/build.sh; see "
                             "k8s/testbed/README.md)")
    if not have:
        print("testbed: building the Kubernetes testbed binaries (once; tens of minutes on 2 cores)",
              file=sys.stderr)
    if subprocess.run(["bash", str(build), *extras], stdout=subprocess.DEVNULL).returncode != 0:
        raise RuntimeFailure("k8s/testbed/build.sh failed (see above)")


def wait_for_build() -> None:
    """Wait for a build.sh that is compiling (both its phases; `build.sh --wait`), build nothing:
    for checks that read what the build leaves, e.g. Kueue's manifests."""
    build = scripts_dir() / "build.sh"
    if shutil.which("go") is not None and build.is_file():
        subprocess.run(["bash", str(build), "--wait"], stdout=subprocess.DEVNULL, check=False)


def _script(action: str, *args: str, quiet: bool = False) -> int:
    env = dict(os.environ, DDPKIT_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join(filter(None, [str(_PACKAGE_DIR.parent),
                                                        os.environ.get("PYTHONPATH")])))
    out = subprocess.DEVNULL if quiet else None
    return subprocess.run(["bash", str(scripts_dir() / "cluster.sh"), action, *args], stdout=out,
                          stderr=out, env=env).returncode


def up() -> None:
    """Bring the cluster up (a no-op when it is already healthy)."""
    _require_root()
    ensure_packages()
    ensure_binaries()
    if _script("up") != 0:
        raise RuntimeFailure("the Kubernetes testbed did not come up (component logs above)")
    for tag in DEFAULT_IMAGES:
        if _docker_image_id(tag):
            load_image(tag)


def down() -> None:
    _require_root()
    if _script("down") != 0:
        raise RuntimeFailure("the Kubernetes testbed was not removed completely (see above)")


def kill_node(index: int) -> None:
    """Node `index` dies as a machine does (cluster.sh `kill-node`): its link first, then its
    kubelet, containerd and containers, SIGKILLed. The Node object stays, NotReady after the
    controller-manager's grace period (20 s here)."""
    _require_root()
    if _script("kill-node", str(index)) != 0:
        raise RuntimeFailure(f"could not kill node {index} (see above)")


def enable_kueue() -> None:
    """Start Kueue on the running cluster (cluster.sh `kueue`; `ddpkit testbed k8s up --kueue`),
    with the LocalQueue KUEUE_QUEUE in namespace default; a no-op when it runs."""
    _require_root()
    ensure_binaries("kueue")
    if _script("kueue") != 0:
        raise RuntimeFailure("Kueue did not start on the Kubernetes testbed (see above)")


def fake_nodes(count: int) -> None:
    """`count` kwok fake nodes beside the real ones (cluster.sh `fake-nodes`; 0 removes them):
    the real scheduler places pods there and kwok plays their kubelet (Ready, pods Running)."""
    _require_root()
    if count:
        ensure_binaries("kwok")
    if _script("fake-nodes", str(count)) != 0:
        raise RuntimeFailure(f"could not make {count} fake nodes (see above)")


#: kwok's fake nodes: label, taint, and how many share a rack (label ddpkit.io/rack)
FAKE_NODE_LABEL = ("type", "kwok")
FAKE_NODE_TAINT = {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}
FAKE_RACK_SIZE = 8
#: kwok's fast stages, less the one that completes a Job's pods at once: on fake nodes training
#: pods stay Running (they hold their node's GPUs) until they are deleted
FAKE_NODE_DROPPED_STAGES = {"pod-complete"}


def fake_node_objects(count: int) -> list[dict]:
    """Node objects for kwok: GPU nodes of 8 nvidia.com/gpu, 32 CPUs and 256 GiB, FAKE_RACK_SIZE
    to a rack (`ddpkit.io/rack: fake-rack-K`), tainted FAKE_NODE_TAINT."""
    resources = {"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": "8"}
    return [{"apiVersion": "v1", "kind": "Node",
             "metadata": {"name": f"kwok-node-{i}",
                          "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                          "labels": {FAKE_NODE_LABEL[0]: FAKE_NODE_LABEL[1], "kubernetes.io/hostname": f"kwok-node-{i}",
                                     "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                                     "topology.kubernetes.io/zone": "testbed-a",
                                     "ddpkit.io/rack": f"fake-rack-{i // FAKE_RACK_SIZE}"}},
             "spec": {"taints": [FAKE_NODE_TAINT]},
             "status": {"allocatable": resources, "capacity": resources}}
            for i in range(count)]


#: With Kueue on: the fake nodes' own queue (LocalQueue FAKE_QUEUE in `default`), a ClusterQueue
#: of that name whose ResourceFlavor selects them and names the Topology FAKE_TOPOLOGY: zone,
#: rack, node (every fake node is in one zone, so a job too big for a rack fits a level up)
FAKE_QUEUE = "fake"
FAKE_TOPOLOGY = "fake-racks"
FAKE_TOPOLOGY_LEVELS = ("topology.kubernetes.io/zone", "ddpkit.io/rack", "kubernetes.io/hostname")


def fake_node_queue(count: int) -> list[dict]:
    """Kueue's Topology, ResourceFlavor, ClusterQueue and LocalQueue for `count` fake nodes: the
    quota is their whole capacity, and the flavor's topology lets a job ask for topology-aware
    scheduling (`k8s.topology`)."""
    api = f"{KUEUE_GROUP}/v1beta2"
    key, value = FAKE_NODE_LABEL
    quota = {"cpu": str(32 * count), "memory": f"{256 * count}Gi", "nvidia.com/gpu": str(8 * count)}
    return [
        {"apiVersion": api, "kind": "Topology", "metadata": {"name": FAKE_TOPOLOGY},
         "spec": {"levels": [{"nodeLabel": label} for label in FAKE_TOPOLOGY_LEVELS]}},
        {"apiVersion": api, "kind": "ResourceFlavor", "metadata": {"name": FAKE_QUEUE},
         "spec": {"nodeLabels": {key: value}, "topologyName": FAKE_TOPOLOGY,
                  "tolerations": [{"key": FAKE_NODE_TAINT["key"], "operator": "Exists",
                                   "effect": FAKE_NODE_TAINT["effect"]}]}},
        {"apiVersion": api, "kind": "ClusterQueue", "metadata": {"name": FAKE_QUEUE},
         "spec": {"namespaceSelector": {}, "resourceGroups": [{"coveredResources": list(quota), "flavors": [
             {"name": FAKE_QUEUE, "resources": [{"name": k, "nominalQuota": v} for k, v in quota.items()]}]}]}},
        {"apiVersion": api, "kind": "LocalQueue", "metadata": {"name": FAKE_QUEUE, "namespace": "default"},
         "spec": {"clusterQueue": FAKE_QUEUE}},
    ]


def revive_node(index: int) -> None:
    """Node `index`, killed by `kill_node`, boots again (cluster.sh `revive-node`): its link
    comes up, its containerd and kubelet start on the state they left (images included), and the
    node is Ready, its GPUs advertised and any out-of-service taint lifted. Seconds, where a
    fresh cluster (down, up, images loaded again) takes minutes."""
    _require_root()
    if _script("revive-node", str(index)) != 0:
        raise RuntimeFailure(f"could not revive node {index} (see above)")


def status(*, quiet: bool = False) -> bool:
    _require_root()
    return _script("status", quiet=quiet) == 0


# --------------------------------------------------------------------------------------------
# images without a registry


def node_sockets() -> list[str]:
    """Each node's containerd socket, node 0 first (each node has its own image store)."""
    found = sorted(testbed_dir().glob("node*/containerd/containerd.sock"),
                   key=lambda p: int(p.parent.parent.name[4:]) if p.parent.parent.name[4:].isdigit() else 0)
    return [str(p) for p in found]


def _ctr(*args: str, address: str | None = None, **kw) -> subprocess.CompletedProcess:
    """`ctr` against one node's containerd: `address`, else DDPKIT_K8S_CTR_ADDRESS (cluster.sh
    sets it per node), else node 0's."""
    address = address or os.environ.get("DDPKIT_K8S_CTR_ADDRESS") or (node_sockets() or [""])[0]
    return subprocess.run([str(bin_dir() / "ctr"), "--address", address, "-n", "k8s.io", *args],
                          capture_output=True, **kw)


def containerd_images(address: str | None = None) -> set[str]:
    out = _ctr("images", "ls", "-q", text=True, address=address)
    return set(out.stdout.split()) if out.returncode == 0 else set()


def _normalized(tag: str) -> str:
    """How containerd names a short Docker reference: ddpkit:0.1 -> docker.io/library/ddpkit:0.1."""
    name = tag if ":" in tag.rsplit("/", 1)[-1] else f"{tag}:latest"
    first = name.split("/", 1)[0]
    if "/" not in name:
        return f"docker.io/library/{name}"
    if "." not in first and ":" not in first and first != "localhost":
        return f"docker.io/{name}"
    return name


def docker_archive(tag: str, files: dict[str, bytes | str], entrypoint: list[str]) -> bytes:
    """A one-layer image as `docker save` writes it. `files` maps an absolute path in the
    image to its content (bytes, mode 0755) or to a symlink target (str)."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        dirs = sorted({str(Path(p).parent).lstrip("/") for p in files} - {""})
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for path, content in sorted(files.items()):
            info = tarfile.TarInfo(path.lstrip("/"))
            if isinstance(content, str):
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, content, 0o777
                tar.addfile(info)
            else:
                info.size, info.mode = len(content), 0o755
                tar.addfile(info, io.BytesIO(content))
    layer_bytes = layer.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": entrypoint, "Env": ["PATH=/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }, sort_keys=True).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    layer_name = diff_id.split(":")[1] + "/layer.tar"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [tag], "Layers": [layer_name]}]).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in ((config_name, config), (layer_name, layer_bytes),
                           ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _import(archive: bytes) -> None:
    imported = _ctr("images", "import", "--no-unpack=false", "-", input=archive)
    if imported.returncode != 0:
        imported = _ctr("images", "import", "-", input=archive)
    if imported.returncode != 0:
        raise RuntimeFailure(f"ctr images import failed: {imported.stderr.decode().strip()}")
    prune_replaced_images()


def prune_replaced_images(address: str | None = None) -> list[str]:
    """Remove the ID references (`sha256:<config digest>`) of images that no tag names any
    more; return them. containerd's CRI plugin keeps one per image it has seen, so re-importing
    a rebuilt tag left the old image behind under its ID, and the kubelet's image GC, which
    would collect it, is off here (thresholds at 100%, as kind sets them): the store grew by an
    image per rebuild (6.9 GB after a day of test-image rebuilds, 2.7 GB once pruned). An ID
    reference whose manifest a tag still names is kept; a running container keeps its
    snapshots either way."""
    rows = [line.split()[:3] for line in _ctr("images", "ls", text=True, address=address).stdout.splitlines()[1:]]
    named = {row[2] for row in rows if len(row) == 3 and not row[0].startswith("sha256:")}
    stale = [row[0] for row in rows if len(row) == 3 and row[0].startswith("sha256:")
             and row[2] not in named]
    if stale:
        _ctr("images", "rm", "--sync", *stale, address=address)
    return stale


def base_images() -> None:
    """Import the pause and busybox images unless containerd already has them."""
    have = containerd_images()
    if _normalized(PAUSE_IMAGE) not in have:
        pause = (bin_dir() / "pause").read_bytes()
        _import(docker_archive(PAUSE_IMAGE, {"/pause": pause}, ["/pause"]))
    if _normalized(BUSYBOX_IMAGE) not in have:
        busybox = Path("/bin/busybox").read_bytes()
        # Debian's dash as sh (with the libc it links): busybox's own sh runs its nslookup
        # applet directly, bypassing the wrapper below
        files: dict[str, bytes | str] = {
            "/bin/busybox": busybox, "/bin/nslookup": NSLOOKUP,
            "/bin/sh": Path("/bin/dash").read_bytes(),
            "/lib64/ld-linux-x86-64.so.2": Path("/lib64/ld-linux-x86-64.so.2").resolve().read_bytes(),
            "/lib/x86_64-linux-gnu/libc.so.6": Path("/lib/x86_64-linux-gnu/libc.so.6").resolve().read_bytes(),
        }
        for applet in ("seq", "sleep", "hostname", "cat", "echo", "ls", "grep", "wget"):
            files[f"/bin/{applet}"] = "busybox"
        _import(docker_archive(BUSYBOX_IMAGE, files, ["/bin/sh"]))


#: training-operator's init container loops on `nslookup <job>-master-0` until it exits 0. The
#: operator's default image (alpine 3.10, busybox 1.30) exits 0 once the name resolves; Debian's
#: busybox 1.35 exits 1 when any search-domain variant is NXDOMAIN, even though the name
#: resolved through another. This keeps the old exit status: 0 when an answer names the host.
NSLOOKUP = b"""#!/bin/sh
out=$(/bin/busybox nslookup "$@" 2>&1)
echo "$out"
echo "$out" | /bin/busybox grep -q '^Name:'
"""


def _docker_image_id(tag: str) -> str:
    try:
        from deploy.image import docker

        out = docker("image", "inspect", "--format", "{{.Id}}", tag, check=False, timeout=30)
    except (RuntimeFailure, OSError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def load_image(tag: str) -> None:
    """Import a Docker image into every node's containerd (`kind load docker-image`): one
    `docker save` to a file beside the stores, then every node that lacks the image (by Docker's
    ID) imports it at once, in parallel; the seconds are printed per node."""
    image_id = _docker_image_id(tag)
    if not image_id:
        raise RuntimeFailure(f"Docker has no image {tag!r}: build it first (ddpkit image build)")
    sockets = node_sockets()
    if not sockets:
        raise RuntimeFailure("the Kubernetes testbed has no node: sudo ddpkit testbed k8s up")
    missing = [a for a in sockets if not _has_image(tag, image_id, a)]
    if not missing:
        return
    from deploy.image import docker_binary, docker_env

    images = Path(os.environ.get("DDPKIT_K8S_TESTBED_IMAGES", "/var/lib/ddpkit-k8s-images"))
    images.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with tempfile.NamedTemporaryFile(dir=images, prefix=".save-", suffix=".tar") as archive:
        saved = subprocess.run([docker_binary(), "save", "--output", archive.name, tag],
                               capture_output=True, text=True, env=docker_env())
        if saved.returncode != 0:
            raise RuntimeFailure(f"docker save {tag} failed: {saved.stderr.strip()}")
        print(f"testbed: saved {tag} in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        with concurrent.futures.ThreadPoolExecutor(len(missing)) as pool:
            list(pool.map(lambda a: _load_into(tag, image_id, a, Path(archive.name)), missing))


def _stamp(tag: str, address: str) -> Path:
    return _stamps(address) / hashlib.sha256(_normalized(tag).encode()).hexdigest()


def _stamps(address: str) -> Path:
    node = Path(address).parent.parent.name  # node<i>
    return Path(os.environ.get("DDPKIT_K8S_TESTBED_IMAGES", "/var/lib/ddpkit-k8s-images")) / node / "loaded"


def remove_image(tag: str) -> None:
    """Remove a loaded image from every node (`ctr images rm --sync`: containerd collects the
    layers no other image shares before it answers; without --sync its collector may wait, and
    did, on one node, keep 9 GB after its images were gone). Tests remove the images they built
    for one test."""
    for address in node_sockets():
        _ctr("images", "rm", "--sync", _normalized(tag), address=address)
        _stamp(tag, address).unlink(missing_ok=True)
        prune_replaced_images(address)


def prune_unloaded_images(address: str | None = None) -> list[str]:
    """At `up`, on one node: remove the images `load_image` put there that Docker no longer has
    as loaded (removed, or rebuilt since: a new ID), so the node stores mirror Docker instead
    of growing with every image any test or bench ever loaded (19 GB on this project's CI
    machine before this). The sandbox and busybox images are the testbed's own and stay; so
    does everything when no Docker daemon answers (nothing to compare with)."""
    address = address or os.environ.get("DDPKIT_K8S_CTR_ADDRESS") or (node_sockets() or [""])[0]
    from deploy.image import docker

    try:
        listed = docker("image", "ls", "--no-trunc", "--format", "{{.Repository}}:{{.Tag}} {{.ID}}",
                        check=False, timeout=60)
    except (RuntimeFailure, OSError):
        return []
    if listed.returncode != 0:
        return []
    docker_ids = {_normalized(ref): image_id for ref, image_id in
                  (line.split() for line in listed.stdout.splitlines() if len(line.split()) == 2)}
    own = {_normalized(PAUSE_IMAGE), _normalized(BUSYBOX_IMAGE)}
    stale = []
    for ref in containerd_images(address) - own:
        if ref.startswith("sha256:"):
            continue
        stamp = _stamp(ref, address)
        loaded = stamp.read_text() if stamp.exists() else None
        if loaded is None or docker_ids.get(ref) != loaded:
            stale.append(ref)
            stamp.unlink(missing_ok=True)
    if stale:
        _ctr("images", "rm", "--sync", *stale, address=address)
    prune_replaced_images(address)
    return stale


def _has_image(tag: str, image_id: str, address: str) -> bool:
    stamp = _stamp(tag, address)
    return stamp.exists() and stamp.read_text() == image_id and _normalized(tag) in containerd_images(address)


def _load_into(tag: str, image_id: str, address: str, archive: Path) -> None:
    node = Path(address).parent.parent.name
    t0 = time.monotonic()
    imported = _ctr("images", "import", str(archive), address=address, text=True)
    if imported.returncode != 0:  # e.g. the disk filled: what the import left is no tag's
        prune_replaced_images(address)
        raise RuntimeFailure(f"loading {tag} into {node} failed: {imported.stderr.strip()}")
    prune_replaced_images(address)
    stamp = _stamp(tag, address)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(image_id)
    print(f"testbed: loaded {tag} into {node}'s containerd in {time.monotonic() - t0:.1f} s", file=sys.stderr)


# --------------------------------------------------------------------------------------------
# upstream manifests, adapted for controllers running as host processes


def manifests_dir(component: str) -> Path:
    return cache_dir() / "manifests" / component


def _kustomize(component: str, path: str) -> list[dict]:
    import yaml

    from deploy.yamlfile import _BASE_LOADER as _LOADER

    root = manifests_dir(component)
    target = root / path
    if component == "trainer":
        # The manager overlay pulls JobSet's release manifests from the network
        # (third-party/jobset); JobSet is installed from its own module here instead.
        text = (target / "kustomization.yaml").read_text()
        kept = [line for line in text.splitlines() if "third-party/jobset" not in line]
        overlay = root / "manifests" / "overlays" / "ddpkit-testbed"
        overlay.mkdir(exist_ok=True)
        (overlay / "kustomization.yaml").write_text("\n".join(kept) + "\n")
        shutil.copy(target / "namespace.yaml", overlay / "namespace.yaml")
        target = overlay
    out = subprocess.run([kubectl(), "kustomize", str(target)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeFailure(f"kubectl kustomize {target}: {out.stderr.strip()}")
    return [d for d in yaml.load_all(out.stdout, Loader=_LOADER) if d]


def _client_config(cc: dict, ca_bundle: str) -> None:
    svc = cc.pop("service", None)
    if svc is None:
        return
    host, port, ours = WEBHOOK_HOST[(svc["namespace"], svc["name"])]
    cc["url"] = f"https://{host}:{port}{svc.get('path', '')}"
    if ours:
        cc["caBundle"] = ca_bundle


def adapt(objects: list[dict], ca_bundle: str, drop: set[str] = DROP_KINDS) -> list[dict]:
    """The upstream objects a host-process controller needs, webhooks pointed at loopback."""
    kept = []
    for obj in objects:
        kind = obj.get("kind")
        if kind in drop:
            continue
        if kind in ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"):
            for hook in obj.get("webhooks", []):
                _client_config(hook["clientConfig"], ca_bundle)
        if kind == "CustomResourceDefinition":
            webhook = ((obj.get("spec") or {}).get("conversion") or {}).get("webhook")
            if webhook:
                _client_config(webhook["clientConfig"], ca_bundle)
        kept.append(obj)
    return kept


CA_PLACEHOLDER = "DDPKIT-TESTBED-CA-BUNDLE"


def adapted_manifests() -> Path:
    """The adapted upstream manifests with a placeholder for the CA, made once per set of
    manifests and version of this file (the CRDs are 6 MB of YAML: slow to parse on every up)."""
    import yaml

    from deploy.yamlfile import Dumper

    key = hashlib.sha256(Path(__file__).read_bytes())
    for component, _ in KUSTOMIZATIONS:
        key.update(str(manifests_dir(component).resolve()).encode())
    cached = cache_dir() / "manifests" / f"testbed-upstream-{key.hexdigest()[:16]}.yaml"
    if not cached.exists():
        objects: list[dict] = []
        for component, path in KUSTOMIZATIONS:
            objects += adapt(_kustomize(component, path), CA_PLACEHOLDER)
        # namespaces first, then CRDs, then the rest (one server-side apply)
        order = {"Namespace": 0, "CustomResourceDefinition": 1}
        objects.sort(key=lambda o: order.get(o["kind"], 2))
        tmp = cached.with_suffix(".tmp")
        tmp.write_text(yaml.dump_all(objects, Dumper=Dumper, sort_keys=False))
        tmp.replace(cached)
    return cached


def write_manifests(outdir: Path, ca_file: Path) -> None:
    import base64

    ca_bundle = base64.b64encode(ca_file.read_bytes()).decode()
    outdir.mkdir(parents=True, exist_ok=True)
    text = adapted_manifests().read_text().replace(CA_PLACEHOLDER, ca_bundle)
    (outdir / "upstream.yaml").write_text(text)
    runtime = manifests_dir("trainer") / "manifests" / "base" / "runtimes" / "torch_distributed.yaml"
    shutil.copy(runtime, outdir / "runtimes.yaml")


def _kueue_webhook_kept(hook: dict) -> bool:
    """A Kueue webhook entry for its own kinds or for an integration the testbed turns on."""
    wanted = set(KUEUE_FRAMEWORKS.values())
    rules = hook.get("rules") or []
    return bool(rules) and all(set(r.get("apiGroups") or []) == {KUEUE_GROUP}
                               or set(r.get("resources") or []) <= wanted for r in rules)


def write_kueue_manifests(outdir: Path, ca_file: Path) -> None:
    """Kueue's upstream `config/default`, adapted like the controllers': no Deployment, Services
    or visibility APIServices (that API server is off: VisibilityOnDemand=false), every webhook
    and conversion webhook on https://127.0.0.1:19446 with our CA, and only the webhook entries
    of its own kinds and of the integrations in KUEUE_FRAMEWORKS."""
    import base64

    import yaml

    from deploy.yamlfile import Dumper

    ca_bundle = base64.b64encode(ca_file.read_bytes()).decode()
    objects = adapt(_kustomize("kueue", "config/default"), ca_bundle, DROP_KINDS | {"APIService"})
    for obj in objects:
        if obj["kind"] in ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"):
            obj["webhooks"] = [h for h in obj.get("webhooks", []) if _kueue_webhook_kept(h)]
    order = {"Namespace": 0, "CustomResourceDefinition": 1}
    objects.sort(key=lambda o: order.get(o["kind"], 2))
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "kueue.yaml").write_text(yaml.dump_all(objects, Dumper=Dumper, sort_keys=False))


def kueue_queues(nodes: list[dict]) -> list[dict]:
    """The testbed's ResourceFlavor, ClusterQueue and LocalQueue (KUEUE_QUEUE), the quota the
    sum of the nodes' allocatable CPU, memory and nvidia.com/gpu."""
    from deploy.units import quantity

    total = {"cpu": Decimal(0), "memory": Decimal(0), "nvidia.com/gpu": Decimal(0)}
    for node in nodes:
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        for resource in total:
            total[resource] += quantity(allocatable.get(resource, 0)) or 0
    quota = {"cpu": f"{int(total['cpu'] * 1000)}m", "memory": str(int(total["memory"])),
             "nvidia.com/gpu": str(int(total["nvidia.com/gpu"]))}
    api = f"{KUEUE_GROUP}/v1beta2"
    return [
        {"apiVersion": api, "kind": "ResourceFlavor", "metadata": {"name": KUEUE_FLAVOR}},
        {"apiVersion": api, "kind": "ClusterQueue", "metadata": {"name": KUEUE_QUEUE},
         "spec": {"namespaceSelector": {},
                  "preemption": {"withinClusterQueue": "LowerPriority"},
                  "resourceGroups": [{"coveredResources": list(quota), "flavors": [
                      {"name": KUEUE_FLAVOR,
                       "resources": [{"name": k, "nominalQuota": v} for k, v in quota.items()]}]}]}},
        {"apiVersion": api, "kind": "LocalQueue", "metadata": {"name": KUEUE_QUEUE, "namespace": "default"},
         "spec": {"clusterQueue": KUEUE_QUEUE}},
    ]


def write_kueue_queues(out: Path) -> None:
    import yaml

    from deploy.yamlfile import Dumper

    nodes = subprocess.run([kubectl(), "--kubeconfig", str(kubeconfig()), "get", "nodes", "-o", "json"],
                           capture_output=True, text=True, check=True)
    out.write_text(yaml.dump_all(kueue_queues(json.loads(nodes.stdout)["items"]), Dumper=Dumper, sort_keys=False))


# --------------------------------------------------------------------------------------------


def main(action: str) -> int:
    """The CLI's `testbed k8s ACTION`."""
    return run_action("k8s", action, up=up, down=down, status=status, env_lines=lambda: [
        f"export KUBECONFIG={shlex.quote(str(kubeconfig()))}",
        f"export PATH={shlex.quote(str(bin_dir()))}:\"$PATH\""])


if __name__ == "__main__":  # the steps cluster.sh hands to Python
    step = sys.argv[1] if len(sys.argv) > 1 else ""
    if step == "_images":
        base_images()
        if pruned := prune_unloaded_images():
            print(f"testbed: removed {len(pruned)} image(s) Docker no longer has as loaded", file=sys.stderr)
    elif step == "_manifests":
        write_manifests(Path(sys.argv[2]), Path(sys.argv[3]))
    elif step == "_kueue_manifests":
        write_kueue_manifests(Path(sys.argv[2]), Path(sys.argv[3]))
    elif step == "_kueue_queues":
        write_kueue_queues(Path(sys.argv[2]))
    elif step == "_fake_nodes":  # COUNT DIR STAGES: DIR/nodes.yaml, and DIR/stages.yaml without pod-complete
        import yaml

        out = Path(sys.argv[3])
        fakes = fake_node_objects(int(sys.argv[2]))
        if (out.parent / "kueue" / "enabled").exists():  # cluster.sh kueue ran: their queue too
            fakes += fake_node_queue(int(sys.argv[2]))
        (out / "nodes.yaml").write_text(yaml.safe_dump_all(fakes, sort_keys=False))
        stages = [d for d in yaml.safe_load_all(Path(sys.argv[4]).read_text()) if d]
        (out / "stages.yaml").write_text(yaml.safe_dump_all(
            [d for d in stages if d["metadata"]["name"] not in FAKE_NODE_DROPPED_STAGES], sort_keys=False))
    elif step == "load" and len(sys.argv) == 3:
        try:
            load_image(sys.argv[2])
        except (RuntimeFailure, UserError) as exc:
            sys.exit(f"error: {exc}")
    else:
        sys.exit("usage: python -m deploy.testbed.k8s load IMAGE  (Docker -> the cluster's containerd)")
