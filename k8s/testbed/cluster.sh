#!/usr/bin/env bash
# cluster.sh up|down|status - a REAL N-node Kubernetes cluster as host processes.
#
# Built from upstream sources by build.sh (cached by version in $CACHE): etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubelet + containerd 2 (runc and the CNI plugins
# from Debian), CoreDNS, and the Kubeflow training-operator, JobSet and Kubeflow Trainer
# controllers with their admission webhooks, installed from their own upstream manifests.
#
#   etcd                   127.0.0.1:$ETCD_PORT (plain http, loopback only)
#   kube-apiserver         https://127.0.0.1:$API_PORT, own CA, Node,RBAC, webhooks admission
#   kube-controller-mgr    127.0.0.1:10357   kube-scheduler 127.0.0.1:10359
#   node i (0..NODES-1)    network namespace ddpk8s-n<i>, address $NET.<11+i> on the bridge
#                          $BRIDGE (host end $GW), pods on $PREFIX.<16+i>.0/24 behind its own
#                          pod bridge; its containerd ($DIR/node<i>/containerd/containerd.sock,
#                          images in $IMAGES/node<i>, kept across down) and its kubelet
#                          (node ddpkit-k8s-node-<i>, 10250 on its address, cgroup root
#                          /ddpkit-k8s-n<i>), labelled with a zone and a rack and advertising
#                          $GPUS nvidia.com/gpu through the node status API (no GPU exists:
#                          the scheduler counts them, nothing else)
#   CoreDNS                $GW:53: cluster.local only, no upstream (no forward plugin)
#   training-operator      webhook https://training-operator.kubeflow.svc:19443 (its own
#                          rotator's cert; the name is a line in /etc/hosts -> 127.0.0.1)
#   JobSet                 webhook https://127.0.0.1:19444 (our CA)
#   Trainer                webhook https://127.0.0.1:19445 (our CA); its TrainJob status
#                          server (feature gate TrainJobStatus) on :19447, which pods reach as
#                          https://kubeflow-trainer-controller-manager.kubeflow-system.svc:19447
#                          (a headless Service whose one endpoint is $GW)
#
# Pods get addresses on their node's /24 and one route, to $PREFIX.0.0/16 (the other nodes'
# pods through the node namespaces' routes, and $GW): no default route inside pods or node
# namespaces and no masquerading, so nothing a pod sends can leave the machine.
# Services are headless (no kube-proxy): ClusterIPs exist but route nowhere.
#
# Called by `ddpkit testbed k8s up|down|status` (deploy/testbed/k8s.py), which sets
# DDPKIT_PYTHON and PYTHONPATH for the manifest and image steps. Needs root.
# Knobs: DDPKIT_K8S_CACHE (/var/cache/ddpkit/k8s: build.sh's output)
#        DDPKIT_K8S_TESTBED_DIR (/var/lib/ddpkit-k8s-testbed: state and logs, removed by down)
#        DDPKIT_K8S_TESTBED_IMAGES (/var/lib/ddpkit-k8s-images: containerd's image store, kept)
#        DDPKIT_K8S_TESTBED_NET (10.252.0: the nodes' /24; services on the next /24, pods
#          on <16+i>)
#        DDPKIT_K8S_TESTBED_NODES (2: kubelets, 1 to 16), DDPKIT_K8S_TESTBED_GPUS (8 per node)
#        DDPKIT_K8S_TESTBED_KEEP_LOGS=DIR (down: copy the logs there first)
set -Eeuo pipefail

CACHE=${DDPKIT_K8S_CACHE:-/var/cache/ddpkit/k8s}
BIN=$CACHE/bin
DIR=${DDPKIT_K8S_TESTBED_DIR:-/var/lib/ddpkit-k8s-testbed}
IMAGES=${DDPKIT_K8S_TESTBED_IMAGES:-/var/lib/ddpkit-k8s-images}
NET=${DDPKIT_K8S_TESTBED_NET:-10.252.0}
PREFIX=${NET%.*}
SVC_NET=$PREFIX.$((${NET##*.} + 1))
GW=$NET.1
BRIDGE=ddpk8s0
POD_BRIDGE=ddpkpods0 # inside each node's namespace
ETCD_PORT=12379
API_PORT=16643
CGROOT=ddpkit-k8s
GPUS=${DDPKIT_K8S_TESTBED_GPUS:-8}
# a cluster that is up keeps the node count it was made with
if [ -f "$DIR/nodes" ]; then NODES=$(cat "$DIR/nodes"); else NODES=${DDPKIT_K8S_TESTBED_NODES:-2}; fi
MARK="# ddpkit-k8s-testbed"
TO_HOST=training-operator.kubeflow.svc
# Kubeflow Trainer's status server, as the controller names it in the pods' env (its webhook
# Service's name and namespace)
TRAINER_STATUS_HOST=kubeflow-trainer-controller-manager.kubeflow-system.svc
TRAINER_STATUS_PORT=19447
PYTHON=${DDPKIT_PYTHON:-python3}
export PATH="$BIN:$PATH"
KUBECTL=$BIN/kubectl
# /etc/hosts is rewritten in place (it may be a bind mount) by this testbed and by the other
# one (deploy/testbed/slurm-testbed.sh, k8s/testbed/cluster.sh), which CI runs side by side:
# one lock for both, else one's rewrite can read the file the other is rewriting, half-written,
# and leave it empty (seen here: localhost stopped resolving). LINES | rewrite_hosts MARK:
# the lines with MARK are replaced by stdin's.
rewrite_hosts() {
  local tmp
  tmp=$(mktemp /etc/hosts.ddpkit.XXXXXX)
  (
    flock 9
    { grep -v "$1" /etc/hosts || true; cat; } >"$tmp"
    cat "$tmp" >/etc/hosts
  ) 9>/etc/hosts.ddpkit.lock
  rm -f "$tmp"
}
node_name() { echo "ddpkit-k8s-node-$1"; }
node_ip() { echo "$NET.$((11 + $1))"; }
pod_net() { echo "$PREFIX.$((${NET##*.} + 16 + $1))"; }
netns() { echo "ddpk8s-n$1"; }
sock() { echo "$DIR/node$1/containerd/containerd.sock"; }
in_node() { # i cmd...: run in node i's network namespace (only that: mounts and cgroups stay the host's)
  local i=$1
  shift
  nsenter --net="/run/netns/$(netns "$i")" "$@"
}
nodes() { seq 0 $((NODES - 1)); }
host_veths() { ip -o link show 2>/dev/null | awk -F': ' '$2 ~ /^ddpk8s-v[0-9]+(@|$)/ {sub(/@.*/, "", $2); print $2}'; }
# processes in start order; down stops them in reverse
daemons() {
  local i
  echo etcd kube-apiserver kube-controller-manager kube-scheduler coredns
  for i in $(nodes); do echo "containerd-$i kubelet-$i"; done
  echo training-operator jobset trainer
  if kueue_on; then echo kueue; fi
  if [ -f "$DIR/kwok/enabled" ]; then echo kwok; fi
}
kueue_on() { [ -f "$DIR/kueue/enabled" ]; }

log() { echo "testbed: $*"; }
fail() { echo "testbed: error: $*" >&2; exit 1; }
kc() { "$KUBECTL" --kubeconfig "$DIR/kubeconfig/admin.kubeconfig" "$@"; }

pid_ok() { # pidfile holds "PID COMM"; alive with that comm and not a zombie?
  local f=$DIR/pids/$1.pid pid comm
  [ -f "$f" ] || return 1
  read -r pid comm <"$f" || return 1
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$comm" ] || return 1
  [ "$(cut -d' ' -f3 "/proc/$pid/stat" 2>/dev/null)" != Z ]
}

healthy() {
  local d i
  [ -f "$DIR/nodes" ] || return 1
  for d in $(daemons); do pid_ok "$d" || return 1; done
  [ "$(timeout 10 "$KUBECTL" --kubeconfig "$DIR/kubeconfig/admin.kubeconfig" get --raw /readyz 2>/dev/null)" = ok ] || return 1
  for i in $(nodes); do node_ready "$i" || return 1; done
}

node_ready() {
  timeout 10 "$KUBECTL" --kubeconfig "$DIR/kubeconfig/admin.kubeconfig" get node "$(node_name "$1")" \
    -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null | grep -qx True
}

stale() {
  [ -d "$DIR" ] && return 0
  ip link show "$BRIDGE" >/dev/null 2>&1 && return 0
  ip netns list 2>/dev/null | grep -q '^ddpk8s-n' && return 0
  [ -n "$(host_veths)" ] && return 0
  grep -q "$MARK" /etc/hosts && return 0
  iptables -S FORWARD 2>/dev/null | grep -q ddpkit-k8s-testbed && return 0
  return 1
}

start_bg() { # name comm cmd... (setsid does not fork here, so $! is the daemon itself)
  local name=$1 comm=$2
  shift 2
  setsid "$@" </dev/null >>"$DIR/log/$name.log" 2>&1 &
  echo "$! $comm" >"$DIR/pids/$name.pid"
}

wait_for() { # seconds description cmd...
  local t=$1 what=$2
  shift 2
  local end=$((SECONDS + t))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $end ] || up_failed "timed out after ${t}s waiting for $what"
    sleep 0.3
  done
}

up_failed() {
  trap - ERR
  echo "testbed: error: $*" >&2
  local f
  for f in "$DIR"/log/*.log; do
    [ -s "$f" ] && { echo "---- tail $f" >&2; tail -n 12 "$f" >&2; }
  done
  if [ -n "${DDPKIT_K8S_TESTBED_KEEP_LOGS:-}" ]; then
    echo "testbed: logs kept in $DDPKIT_K8S_TESTBED_KEEP_LOGS" >&2
  fi
  echo "testbed: removing the partial cluster" >&2
  teardown
  exit 1
}

# ------------------------------------------------------------------------------------------
# certificates and kubeconfigs

cert() { # name CN O [SANs]: a key and a certificate signed by the testbed CA
  local name=$1 cn=$2 o=$3 san=${4:-} ext=$DIR/pki/$1.ext
  printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n' >"$ext"
  [ -n "$san" ] && echo "subjectAltName=$san" >>"$ext"
  openssl ecparam -name prime256v1 -genkey -noout -out "$DIR/pki/$name.key" 2>/dev/null
  openssl req -new -key "$DIR/pki/$name.key" -subj "/CN=$cn${o:+/O=$o}" -out "$DIR/pki/$name.csr" 2>/dev/null
  openssl x509 -req -in "$DIR/pki/$name.csr" -CA "$DIR/pki/ca.crt" -CAkey "$DIR/pki/ca.key" \
    -set_serial "0x$(openssl rand -hex 8)" -days 30 -extfile "$ext" -out "$DIR/pki/$name.crt" 2>/dev/null
}

kubeconfig() { # name [token]: a kubeconfig for the client certificate $name (or a token)
  local f=$DIR/kubeconfig/$1.kubeconfig user
  if [ -n "${2:-}" ]; then
    user="token: $2"
  else
    user="client-certificate: $DIR/pki/$1.crt
    client-key: $DIR/pki/$1.key"
  fi
  (umask 077 && cat >"$f") <<EOF
apiVersion: v1
kind: Config
clusters:
- name: ddpkit-testbed
  cluster:
    server: https://$GW:$API_PORT
    certificate-authority: $DIR/pki/ca.crt
users:
- name: $1
  user:
    $user
contexts:
- name: ddpkit-testbed
  context: {cluster: ddpkit-testbed, user: $1, namespace: default}
current-context: ddpkit-testbed
EOF
}

make_pki() {
  openssl ecparam -name prime256v1 -genkey -noout -out "$DIR/pki/ca.key" 2>/dev/null
  openssl req -x509 -new -key "$DIR/pki/ca.key" -subj "/CN=ddpkit-k8s-testbed-ca" -days 30 \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$DIR/pki/ca.crt" 2>/dev/null
  openssl ecparam -name prime256v1 -genkey -noout -out "$DIR/pki/sa.key" 2>/dev/null
  openssl ec -in "$DIR/pki/sa.key" -pubout -out "$DIR/pki/sa.pub" 2>/dev/null
  # name CN O [SANs], made in parallel (openssl start-up dominates)
  local specs=(
    "apiserver|kube-apiserver||DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost,IP:127.0.0.1,IP:$GW,IP:$SVC_NET.1"
    "apiserver-kubelet-client|kube-apiserver-kubelet-client|system:masters|"
    "webhook-serving|ddpkit-testbed-webhooks||IP:127.0.0.1,IP:$GW,DNS:$TRAINER_STATUS_HOST"
    "admin|ddpkit-admin|system:masters|"
    "kube-controller-manager|system:kube-controller-manager||"
    "kube-scheduler|system:kube-scheduler||"
    "coredns|ddpkit-coredns||"
  )
  local i
  for i in $(nodes); do # each kubelet: a serving certificate for its address, a client one for its node
    specs+=("kubelet-serving-$i|system:node:$(node_name "$i")|system:nodes|DNS:$(node_name "$i"),IP:$(node_ip "$i")"
      "kubelet-$i|system:node:$(node_name "$i")|system:nodes|")
  done
  local spec name cn o san
  for spec in "${specs[@]}"; do
    IFS='|' read -r name cn o san <<<"$spec"
    cert "$name" "$cn" "$o" "$san" &
  done
  wait
  for spec in "${specs[@]}"; do
    [ -s "$DIR/pki/${spec%%|*}.crt" ] || up_failed "could not make the certificate ${spec%%|*}"
  done
  local n
  for n in admin kube-controller-manager kube-scheduler coredns $(for i in $(nodes); do echo "kubelet-$i"; done); do
    kubeconfig "$n"
  done
}

# ------------------------------------------------------------------------------------------
# host set-up that down undoes

host_setup() {
  # inotify limits are per user, not per namespace: every kubelet and containerd takes instances
  # (kind's advice for several nodes: 512 instances; raised only, never lowered, left after down)
  (($(cat /proc/sys/fs/inotify/max_user_instances) >= 512)) || sysctl -qw fs.inotify.max_user_instances=512
  ip link add "$BRIDGE" type bridge
  ip addr add "$GW/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  local i j
  for i in $(nodes); do # node i: a network namespace on the bridge, routing its pods' /24
    ip netns add "$(netns "$i")"
    ip link add "ddpk8s-v$i" type veth peer name eth0 netns "$(netns "$i")"
    ip link set "ddpk8s-v$i" master "$BRIDGE" up
    in_node "$i" ip addr add "$(node_ip "$i")/24" dev eth0
    in_node "$i" ip link set eth0 up
    in_node "$i" ip link set lo up
    in_node "$i" sysctl -qw net.ipv4.ip_forward=1
    ip route add "$(pod_net "$i").0/24" via "$(node_ip "$i")" dev "$BRIDGE" # CoreDNS's answers
    for j in $(nodes); do
      [ "$i" = "$j" ] || in_node "$i" ip route add "$(pod_net "$j").0/24" via "$(node_ip "$j")" dev eth0
    done
  done
  # pods on the bridge talk to each other even where br_netfilter sends bridged frames
  # through a FORWARD chain with policy DROP (dockerd sets that)
  iptables -I FORWARD -i "$BRIDGE" -o "$BRIDGE" -j ACCEPT -m comment --comment ddpkit-k8s-testbed
  echo "127.0.0.1 $TO_HOST $MARK" | rewrite_hosts "$MARK"
  # cgroup v1 (hybrid) host: each kubelet's cgroupRoot must exist in every controller
  local c
  for c in /sys/fs/cgroup/*/; do
    [ -d "$c" ] && [ ! -L "${c%/}" ] || continue
    for i in $(nodes); do
      mkdir -p "$c$CGROOT-n$i"
      if [ -f "$c/cpuset.cpus" ]; then
        cat "$c/cpuset.cpus" >"$c$CGROOT-n$i/cpuset.cpus"
        cat "$c/cpuset.mems" >"$c$CGROOT-n$i/cpuset.mems"
      fi
    done
  done
  # volumes the kubelet mounts after a container started must reach it (kind makes / rshared;
  # here only each kubelet's own directory)
  for i in $(nodes); do
    mkdir -p "$DIR/node$i/kubelet"
    mount --bind "$DIR/node$i/kubelet" "$DIR/node$i/kubelet"
    mount --make-rshared "$DIR/node$i/kubelet"
  done
}

# ------------------------------------------------------------------------------------------
# configuration files

write_node_configs() { # i: node i's CNI network, containerd and kubelet
  local i=$1 d=$DIR/node$1
  mkdir -p "$d/cni/net.d" "$d/cni/ipam" "$d/containerd" "$d/pod-logs"
  cat >"$d/cni/net.d/10-ddpkit.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "ddpkit-k8s-testbed",
  "plugins": [{
    "type": "bridge", "bridge": "$POD_BRIDGE", "isGateway": true, "ipMasq": false,
    "hairpinMode": true,
    "ipam": {"type": "host-local", "dataDir": "$d/cni/ipam",
             "ranges": [[{"subnet": "$(pod_net "$i").0/24", "gateway": "$(pod_net "$i").1", "rangeStart": "$(pod_net "$i").10"}]],
             "routes": [{"dst": "$PREFIX.0.0/16"}]}
  }]
}
EOF
  cat >"$d/containerd/config.toml" <<EOF
version = 3
root = "$IMAGES/node$i/root"
state = "$d/containerd/state"
disabled_plugins = ["io.containerd.nri.v1.nri", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "$(sock "$i")"
[ttrpc]
  address = "$(sock "$i").ttrpc"
[debug]
  address = ""
[metrics]
  address = ""

[plugins]
  [plugins.'io.containerd.internal.v1.opt']
    path = "$d/containerd/opt"
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = "overlayfs"
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = "ddpkit-pause:3.10"
  [plugins.'io.containerd.cri.v1.runtime']
    netns_mounts_under_state_dir = true
    # this machine withholds CAP_SYS_RESOURCE even from root: runc cannot set a pod's
    # oom_score_adj below containerd's own (the kubelet asks -998 for the sandbox)
    restrict_oom_score_adj = true
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ["/usr/lib/cni"]
      conf_dir = "$d/cni/net.d"
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = "runc"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = "$(command -v runc)"
          Root = "$d/containerd/runc"
          SystemdCgroup = false
  [plugins.'io.containerd.grpc.v1.cri']
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
EOF
  : >"$d/resolv.conf"
  cat >"$d/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $(node_ip "$i")
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
tlsCertFile: $DIR/pki/kubelet-serving-$i.crt
tlsPrivateKeyFile: $DIR/pki/kubelet-serving-$i.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $DIR/pki/ca.crt}
authorization: {mode: Webhook}
containerRuntimeEndpoint: unix://$(sock "$i")
cgroupDriver: cgroupfs
cgroupRoot: /$CGROOT-n$i
cgroupsPerQOS: true
failCgroupV1: false
failSwapOn: false
clusterDNS: [$GW]
clusterDomain: cluster.local
resolvConf: $d/resolv.conf
podLogsDir: $d/pod-logs
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "0%", nodefs.available: "0%", nodefs.inodesFree: "0%", imagefs.available: "0%"}
serializeImagePulls: false
maxPods: 50
EOF
}

write_configs() {
  local i
  for i in $(nodes); do write_node_configs "$i"; done
  cat >"$DIR/scheduler.yaml" <<EOF
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection: {kubeconfig: $DIR/kubeconfig/kube-scheduler.kubeconfig}
leaderElection: {leaderElect: false}
EOF
  # no forward plugin: a name outside the cluster is NXDOMAIN (no upstream traffic); a zone
  # block of its own, as template runs before kubernetes inside one block
  cat >"$DIR/Corefile" <<EOF
cluster.local:53 in-addr.arpa:53 ip6.arpa:53 {
    bind $GW
    errors
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $DIR/kubeconfig/coredns.kubeconfig ddpkit-testbed
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }
}
.:53 {
    bind $GW
    errors
    template ANY ANY {
        rcode NXDOMAIN
    }
}
EOF
  mkdir -p "$DIR/jobset/certs" "$DIR/trainer/tmp/k8s-webhook-server/serving-certs" \
    "$DIR/training-operator/tmp"
  cp "$DIR/pki/webhook-serving.crt" "$DIR/jobset/certs/tls.crt"
  cp "$DIR/pki/webhook-serving.key" "$DIR/jobset/certs/tls.key"
  cp "$DIR/pki/webhook-serving.crt" "$DIR/trainer/tmp/k8s-webhook-server/serving-certs/tls.crt"
  cp "$DIR/pki/webhook-serving.key" "$DIR/trainer/tmp/k8s-webhook-server/serving-certs/tls.key"
  cat >"$DIR/jobset/config.yaml" <<EOF
apiVersion: config.jobset.x-k8s.io/v1alpha1
kind: Configuration
leaderElection: {leaderElect: false}
internalCertManagement: {enable: false}
webhook: {port: 19444, host: 127.0.0.1, certDir: $DIR/jobset/certs}
metrics: {bindAddress: "0"}
health: {healthProbeBindAddress: "127.0.0.1:18082"}
EOF
  cat >"$DIR/trainer/config.yaml" <<EOF
apiVersion: config.trainer.kubeflow.org/v1alpha1
kind: Configuration
health: {healthProbeBindAddress: "127.0.0.1:18083", readinessEndpointName: readyz, livenessEndpointName: healthz}
metrics: {bindAddress: "0"}
webhook: {port: 19445, host: 127.0.0.1}
leaderElection: {leaderElect: false}
certManagement: {enable: false}
featureGates: {TrainJobStatus: true}
statusServer: {port: $TRAINER_STATUS_PORT}
EOF
}

coredns_rbac() {
  kc apply -f - >/dev/null <<EOF
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "ddpkit:coredns"}
rules:
- apiGroups: [""]
  resources: [endpoints, services, pods, namespaces]
  verbs: [list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "ddpkit:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "ddpkit:coredns"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: ddpkit-coredns}
EOF
}

# ------------------------------------------------------------------------------------------
# up

start_control_plane() {
  log "etcd 127.0.0.1:$ETCD_PORT"
  start_bg etcd etcd etcd --name ddpkit --data-dir "$DIR/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls http://127.0.0.1:12380 --initial-advertise-peer-urls http://127.0.0.1:12380 \
    --initial-cluster ddpkit=http://127.0.0.1:12380 --unsafe-no-fsync --log-level warn \
    --listen-metrics-urls ""
  wait_for 30 "etcd" curl -sf "http://127.0.0.1:$ETCD_PORT/health"

  log "kube-apiserver https://$GW:$API_PORT"
  start_bg kube-apiserver kube-apiserver kube-apiserver \
    --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address "$GW" --secure-port "$API_PORT" --advertise-address "$GW" \
    --tls-cert-file "$DIR/pki/apiserver.crt" --tls-private-key-file "$DIR/pki/apiserver.key" \
    --client-ca-file "$DIR/pki/ca.crt" \
    --requestheader-client-ca-file "$DIR/pki/ca.crt" --requestheader-allowed-names ddpkit-front-proxy \
    --service-account-issuer "https://$GW:$API_PORT" --service-account-issuer https://kubernetes.default.svc \
    --service-account-key-file "$DIR/pki/sa.pub" --service-account-signing-key-file "$DIR/pki/sa.key" \
    --service-cluster-ip-range "$SVC_NET.0/24" \
    --authorization-mode Node,RBAC \
    --enable-admission-plugins NodeRestriction,ServiceAccount,MutatingAdmissionWebhook,ValidatingAdmissionWebhook \
    --kubelet-client-certificate "$DIR/pki/apiserver-kubelet-client.crt" \
    --kubelet-client-key "$DIR/pki/apiserver-kubelet-client.key" \
    --kubelet-certificate-authority "$DIR/pki/ca.crt" \
    --kubelet-preferred-address-types InternalIP \
    --allow-privileged=true --profiling=false --cert-dir "$DIR/apiserver"
  wait_for 60 "kube-apiserver /readyz" bash -c "[ \"\$('$KUBECTL' --kubeconfig '$DIR/kubeconfig/admin.kubeconfig' get --raw /readyz 2>/dev/null)\" = ok ]"

  log "kube-controller-manager, kube-scheduler"
  start_bg kube-controller-manager kube-controller kube-controller-manager \
    --kubeconfig "$DIR/kubeconfig/kube-controller-manager.kubeconfig" \
    --authentication-kubeconfig "$DIR/kubeconfig/kube-controller-manager.kubeconfig" \
    --authorization-kubeconfig "$DIR/kubeconfig/kube-controller-manager.kubeconfig" \
    --controllers '*' --leader-elect=false --use-service-account-credentials \
    --service-account-private-key-file "$DIR/pki/sa.key" --root-ca-file "$DIR/pki/ca.crt" \
    --cluster-signing-cert-file "$DIR/pki/ca.crt" --cluster-signing-key-file "$DIR/pki/ca.key" \
    --node-monitor-grace-period 20s \
    --service-cluster-ip-range "$SVC_NET.0/24" \
    --bind-address 127.0.0.1 --secure-port 10357 --cert-dir "$DIR/kcm"
  start_bg kube-scheduler kube-scheduler kube-scheduler --config "$DIR/scheduler.yaml" \
    --authentication-kubeconfig "$DIR/kubeconfig/kube-scheduler.kubeconfig" \
    --authorization-kubeconfig "$DIR/kubeconfig/kube-scheduler.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port 10359 --cert-dir "$DIR/scheduler"

  log "CoreDNS $GW:53"
  coredns_rbac
  start_bg coredns coredns coredns -conf "$DIR/Corefile"
  wait_for 20 "CoreDNS" bash -c "exec 3<>/dev/tcp/$GW/53"
}

start_node() { # i: node i's containerd (its images imported) and kubelet, in its network namespace
  local i=$1 name
  name=$(node_name "$i")
  log "node $name at $(node_ip "$i"): containerd $(sock "$i")"
  mkdir -p "$IMAGES/node$i"
  start_bg "containerd-$i" containerd nsenter --net="/run/netns/$(netns "$i")" containerd --config "$DIR/node$i/containerd/config.toml"
  wait_for 30 "containerd of node $i" ctr --address "$(sock "$i")" version
  DDPKIT_K8S_CTR_ADDRESS=$(sock "$i") "$PYTHON" -m deploy.testbed.k8s _images ||
    up_failed "could not import the pause and busybox images into node $i's containerd"
  log "node $name: kubelet"
  start_bg "kubelet-$i" kubelet nsenter --net="/run/netns/$(netns "$i")" kubelet --config "$DIR/node$i/kubelet.yaml" \
    --kubeconfig "$DIR/kubeconfig/kubelet-$i.kubeconfig" --root-dir "$DIR/node$i/kubelet" \
    --hostname-override "$name" --node-ip "$(node_ip "$i")" --cert-dir "$DIR/node$i/kubelet-pki" \
    --node-labels "topology.kubernetes.io/zone=testbed-a,ddpkit.io/rack=rack-$((i / 2))" --v 1
}

wait_nodes() { # every node Ready, then its GPUs advertised
  local i
  for i in $(nodes); do wait_for 120 "node $(node_name "$i") to be Ready" node_ready "$i"; done
  for i in $(nodes); do advertise_gpus "$i"; done
}

advertise_gpus() { # i: $GPUS nvidia.com/gpu in node i's capacity (the documented way: the status
  # API), then wait until the kubelet's next status update counts them allocatable
  local name
  name=$(node_name "$1")
  kc patch node "$name" --subresource=status --type=merge \
    -p "{\"status\":{\"capacity\":{\"nvidia.com/gpu\":\"$GPUS\"}}}" >/dev/null
  wait_for 30 "node $name to count $GPUS allocatable nvidia.com/gpu" bash -c \
    "'$KUBECTL' --kubeconfig '$DIR/kubeconfig/admin.kubeconfig' get node $name -o 'jsonpath={.status.allocatable.nvidia\\.com/gpu}' | grep -qx '$GPUS'"
}

install_controllers() {
  local name ns
  log "upstream CRDs, RBAC and webhook configurations"
  "$PYTHON" -m deploy.testbed.k8s _manifests "$DIR/manifests" "$DIR/pki/ca.crt" ||
    up_failed "could not render the upstream manifests"
  kc apply --server-side --force-conflicts -f "$DIR/manifests/upstream.yaml" >"$DIR/log/apply.log" 2>&1 ||
    up_failed "kubectl apply of the upstream manifests failed: $(tail -3 "$DIR/log/apply.log")"
  kc wait --for condition=Established --timeout 60s crd/pytorchjobs.kubeflow.org \
    crd/jobsets.jobset.x-k8s.io crd/trainjobs.trainer.kubeflow.org \
    crd/clustertrainingruntimes.trainer.kubeflow.org >/dev/null

  # the controllers run as their upstream ServiceAccounts, under their own RBAC
  local sa
  for sa in training-operator:kubeflow:training-operator jobset:jobset-system:jobset-controller-manager \
    trainer:kubeflow-system:kubeflow-trainer-controller-manager; do
    IFS=: read -r name ns sa <<<"$sa"
    kubeconfig "$name" "$(kc -n "$ns" create token "$sa" --duration 720h)"
  done

  log "training-operator (PyTorchJob), webhook https://$TO_HOST:19443"
  start_training_operator
  log "JobSet, webhook https://127.0.0.1:19444"
  start_bg jobset jobset env KUBECONFIG="$DIR/kubeconfig/jobset.kubeconfig" jobset \
    --config "$DIR/jobset/config.yaml" --leader-elect=false --metrics-bind-address=0 \
    --health-probe-bind-address=127.0.0.1:18082
  log "Kubeflow Trainer, webhook https://127.0.0.1:19445, status server https://$TRAINER_STATUS_HOST:$TRAINER_STATUS_PORT"
  trainer_status_server
  start_trainer

  wait_for 60 "training-operator's certificate in its Secret" bash -c \
    "'$KUBECTL' --kubeconfig '$DIR/kubeconfig/admin.kubeconfig' -n kubeflow get secret training-operator-webhook-cert -o 'jsonpath={.data.tls\\.key}' | grep -q ."
  local certs=$DIR/training-operator/tmp/k8s-webhook-server/serving-certs k
  mkdir -p "$certs"
  for k in tls.crt tls.key; do
    kc -n kubeflow get secret training-operator-webhook-cert -o "jsonpath={.data.${k/./\\.}}" | base64 -d >"$certs/$k.tmp"
    mv "$certs/$k.tmp" "$certs/$k"
  done
  wait_for 180 "training-operator readyz" training_operator_ready
  wait_for 60 "JobSet readyz" curl -sf http://127.0.0.1:18082/readyz
  wait_for 60 "Trainer readyz" curl -sf http://127.0.0.1:18083/readyz
  # the ClusterTrainingRuntime goes through Trainer's validating webhook
  wait_for 60 "the torch-distributed ClusterTrainingRuntime (Trainer's webhook)" \
    "$KUBECTL" --kubeconfig "$DIR/kubeconfig/admin.kubeconfig" apply --server-side -f "$DIR/manifests/runtimes.yaml"
}

trainer_status_server() {
  # What Trainer's TrainJob status server needs of a cluster (pkg/statusserver, v2.3.0): the CA
  # of its serving certificate in its webhook Secret (copied into each TrainJob's
  # NAME-tls-config ConfigMap, which the pods trust), and a name the pods resolve: a headless
  # Service whose one endpoint is the host. It verifies the pods' projected tokens by OIDC
  # discovery of the issuer named in its own in-cluster token, so the API server's first issuer
  # is its own URL, which a host process reaches (start_trainer gives it that token).
  kc apply --server-side --force-conflicts -f - >/dev/null <<EOF
apiVersion: v1
kind: Secret
metadata: {name: kubeflow-trainer-webhook-cert, namespace: kubeflow-system}
data: {ca.crt: $(base64 -w0 <"$DIR/pki/ca.crt")}
---
apiVersion: v1
kind: Service
metadata: {name: ${TRAINER_STATUS_HOST%%.*}, namespace: kubeflow-system}
spec:
  clusterIP: None
  ports: [{name: status, port: $TRAINER_STATUS_PORT}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: ${TRAINER_STATUS_HOST%%.*}-host
  namespace: kubeflow-system
  labels: {kubernetes.io/service-name: ${TRAINER_STATUS_HOST%%.*}, endpointslice.kubernetes.io/managed-by: ddpkit-testbed}
addressType: IPv4
ports: [{name: status, port: $TRAINER_STATUS_PORT, protocol: TCP}]
endpoints: [{addresses: ["$GW"]}]
EOF
  mkdir -p "$DIR/trainer/serviceaccount" /run/secrets/kubernetes.io/serviceaccount
  kc -n kubeflow-system create token kubeflow-trainer-controller-manager --duration 720h >"$DIR/trainer/serviceaccount/token"
  echo kubeflow-system >"$DIR/trainer/serviceaccount/namespace"
}

start_trainer() {
  # a mount namespace: the status server reads its certificate from the hard-coded
  # /tmp/k8s-webhook-server/serving-certs, and the issuer from the in-cluster token file
  start_bg trainer trainer-control unshare --mount --propagation private sh -c \
    "mount --bind '$DIR/trainer/tmp' /tmp && mount --bind '$DIR/trainer/serviceaccount' /run/secrets/kubernetes.io/serviceaccount && exec env KUBECONFIG='$DIR/kubeconfig/trainer.kubeconfig' TMPDIR=/tmp trainer-controller-manager --config '$DIR/trainer/config.yaml'"
}

start_training_operator() {
  # its cert rotator writes the certificate into a Secret and waits for it in the hard-coded
  # /tmp/k8s-webhook-server/serving-certs: give it a /tmp of its own (a mount namespace)
  start_bg training-operator training-operat unshare --mount --propagation private sh -c \
    "mount --bind '$DIR/training-operator/tmp' /tmp && exec env KUBECONFIG='$DIR/kubeconfig/training-operator.kubeconfig' MY_POD_NAMESPACE=kubeflow training-operator.v1 --enable-scheme=pytorchjob --leader-elect=false --metrics-bind-address=127.0.0.1:18080 --health-probe-bind-address=127.0.0.1:18081 --webhook-server-port=19443 --pytorch-init-container-image=ddpkit-busybox:3"
}

training_operator_ready() {
  # Its webhook server reads the certificate once, when it starts: on a loaded machine that
  # can come before `up` copied it from the Secret, and the operator exits ("open
  # /tmp/k8s-webhook-server/serving-certs/tls.key: no such file or directory"; CI, session
  # 11, beside the rest of the suite). The certificate is in place now: start it again.
  pid_ok training-operator || start_training_operator
  curl -sf http://127.0.0.1:18081/readyz
}

kueue() { # Kueue as a host process on the running cluster (idempotent): its CRDs, RBAC and
  # webhooks (deploy/testbed/k8s.py write_kueue_manifests), then the manager, then the queues
  # (through its own webhooks, so after its readyz). `up` does it with DDPKIT_K8S_TESTBED_KUEUE=1.
  [ -x "$BIN/kueue" ] || fail "missing $BIN/kueue: build it first (bash k8s/testbed/build.sh kueue)"
  if kueue_on && pid_ok kueue; then
    log "Kueue already running"
    return 0
  fi
  log "Kueue: CRDs, RBAC and webhooks, webhook https://127.0.0.1:19446"
  mkdir -p "$DIR/kueue/certs" "$DIR/kueue/etc/metrics/certs"
  local d
  for d in "$DIR/kueue/certs" "$DIR/kueue/etc/metrics/certs"; do
    cp "$DIR/pki/webhook-serving.crt" "$d/tls.crt"
    cp "$DIR/pki/webhook-serving.key" "$d/tls.key"
  done
  cat >"$DIR/kueue/config.yaml" <<EOF
apiVersion: config.kueue.x-k8s.io/v1beta2
kind: Configuration
namespace: kueue-system
leaderElection: {leaderElect: false}
internalCertManagement: {enable: false}
webhook: {host: 127.0.0.1, port: 19446, certDir: $DIR/kueue/certs}
health: {healthProbeBindAddress: "127.0.0.1:18084"}
metrics: {bindAddress: "0"}
featureGates: {VisibilityOnDemand: false}
integrations:
  frameworks: ["batch/job", "kubeflow.org/pytorchjob", "jobset.x-k8s.io/jobset", "trainer.kubeflow.org/trainjob"]
EOF
  "$PYTHON" -m deploy.testbed.k8s _kueue_manifests "$DIR/manifests" "$DIR/pki/ca.crt" ||
    fail "could not render Kueue's manifests"
  kc apply --server-side --force-conflicts -f "$DIR/manifests/kueue.yaml" >"$DIR/log/apply-kueue.log" 2>&1 ||
    fail "kubectl apply of Kueue's manifests failed: $(tail -3 "$DIR/log/apply-kueue.log")"
  kc wait --for condition=Established --timeout 60s crd/workloads.kueue.x-k8s.io \
    crd/clusterqueues.kueue.x-k8s.io crd/localqueues.kueue.x-k8s.io >/dev/null
  kubeconfig kueue "$(kc -n kueue-system create token kueue-controller-manager --duration 720h)"
  # with its own certificates off, Kueue loads a metrics certificate from the hard-coded
  # /etc/kueue/metrics/certs even with metrics off: give it one there, in a mount namespace of its own
  mkdir -p /etc/kueue
  touch "$DIR/kueue/enabled"
  start_bg kueue kueue unshare --mount --propagation private sh -c \
    "mount --bind '$DIR/kueue/etc' /etc/kueue && exec env KUBECONFIG='$DIR/kubeconfig/kueue.kubeconfig' kueue --config '$DIR/kueue/config.yaml' --zap-log-level=2"
  wait_for 90 "Kueue readyz" curl -sf http://127.0.0.1:18084/readyz
  "$PYTHON" -m deploy.testbed.k8s _kueue_queues "$DIR/manifests/kueue-queues.yaml" ||
    fail "could not size Kueue's queues"
  wait_for 60 "Kueue's queues (its webhooks)" \
    "$KUBECTL" --kubeconfig "$DIR/kubeconfig/admin.kubeconfig" apply --server-side -f "$DIR/manifests/kueue-queues.yaml"
  log "Kueue up: LocalQueue ddpkit in namespace default (k8s.queue: ddpkit)"
}

fake_nodes() { # N: N kwok fake nodes beside the real ones (8 per rack, 8 GPUs each, tainted
  # kwok.x-k8s.io/node=fake:NoSchedule so only pods that tolerate it land there); 0 removes them
  local n=${1:-}
  if ! [[ $n =~ ^[0-9]+$ ]] || ((n > 512)); then fail "fake-nodes: give a count 0..512"; fi
  { [ -f "$DIR/nodes" ] && pid_ok kube-apiserver; } || fail "fake-nodes: the cluster is not up"
  kc delete node -l type=kwok --wait=true --timeout 120s >/dev/null
  stop kwok
  rm -rf "$DIR/kwok"
  if ((n == 0)); then
    log "fake nodes removed"
    return 0
  fi
  [ -x "$BIN/kwok" ] || fail "missing $BIN/kwok: bash k8s/testbed/build.sh kwok"
  mkdir -p "$DIR/kwok"
  "$PYTHON" -m deploy.testbed.k8s _fake_nodes "$n" "$DIR/kwok" "$CACHE/manifests/kwok/stage-fast.yaml" ||
    fail "could not write the fake nodes"
  touch "$DIR/kwok/enabled"
  start_bg kwok kwok kwok --kubeconfig "$DIR/kubeconfig/admin.kubeconfig" \
    --manage-nodes-with-label-selector type=kwok --config "$DIR/kwok/stages.yaml" \
    --node-lease-duration-seconds 40 --cidr 10.253.0.0/16 --node-ip 10.254.0.1
  kc apply --server-side -f "$DIR/kwok/nodes.yaml" >/dev/null
  local t0=$SECONDS
  until [ "$(kc get nodes -l type=kwok -o 'jsonpath={range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' | grep -cx True)" = "$n" ]; do
    ((SECONDS - t0 < 180)) || fail "fake-nodes: not all $n kwok nodes Ready after 180 s (log: $DIR/log/kwok.log)"
    sleep 1
  done
  log "$n fake nodes Ready in $((SECONDS - t0)) s (kwok $("$BIN/kwok" --version 2>/dev/null | awk '{print $3}'))"
}

write_env() {
  cat >"$DIR/env.sh" <<EOF
export KUBECONFIG=$DIR/kubeconfig/admin.kubeconfig
export PATH=$BIN:\$PATH
EOF
}

up() {
  local t0=$SECONDS b i want=${DDPKIT_K8S_TESTBED_NODES:-}
  if [ -n "$want" ] && [ -f "$DIR/nodes" ] && [ "$want" != "$NODES" ]; then
    log "up with $NODES node(s), $want asked for: removing it first"
    teardown
    NODES=$want
  fi
  if healthy; then
    log "already up ($DIR)"
    if [ -n "${DDPKIT_K8S_TESTBED_KUEUE:-}" ]; then kueue; fi
    return 0
  fi
  for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl containerd \
    containerd-shim-runc-v2 ctr coredns training-operator.v1 jobset trainer-controller-manager; do
    [ -x "$BIN/$b" ] || fail "missing $BIN/$b: build the binaries first (bash k8s/testbed/build.sh)"
  done
  for b in runc iptables openssl curl unshare setsid mount ip; do
    command -v "$b" >/dev/null || fail "missing command $b (apt-get install -y --no-install-recommends runc containernetworking-plugins iptables)"
  done
  [ -x /usr/lib/cni/bridge ] || fail "missing /usr/lib/cni/bridge (apt-get install -y containernetworking-plugins)"
  if stale; then
    log "found a stale or partial cluster: removing it first"
    teardown
  fi
  local port busy=""
  for port in $ETCD_PORT 12380 $API_PORT 10357 10359 19443 19444 19445 19446 19447 18080 18081 18082 18083 18084; do
    ss -Hltn "sport = :$port" | grep -q . && busy="$busy $port"
  done
  [ -z "$busy" ] || fail "TCP ports already in use on this host:$busy (another cluster? see ss -ltnp)"
  ip -4 addr show | grep -q "inet $PREFIX\." && fail "addresses in $PREFIX.0.0/16 are already used on this host; set DDPKIT_K8S_TESTBED_NET"
  if ! [[ $NODES =~ ^[0-9]+$ ]] || ((NODES < 1 || NODES > 16)); then
    fail "DDPKIT_K8S_TESTBED_NODES=$NODES: give 1 to 16 nodes"
  fi
  trap 'up_failed "command failed (line $LINENO): $BASH_COMMAND"' ERR
  mkdir -p "$DIR"/{pids,log,pki,kubeconfig,manifests}
  echo "$NODES" >"$DIR/nodes"
  chmod 700 "$DIR/pki"
  make_pki
  host_setup
  write_configs
  start_control_plane
  for i in $(nodes); do start_node "$i"; done
  wait_nodes
  wait_for 60 "the default ServiceAccount" kc -n default get serviceaccount default
  install_controllers
  if [ -n "${DDPKIT_K8S_TESTBED_KUEUE:-}" ]; then kueue; fi
  write_env
  trap - ERR
  log "up in $((SECONDS - t0)) s"
  kc get node -o wide -L topology.kubernetes.io/zone,ddpkit.io/rack
  log "use: eval \"\$(ddpkit testbed k8s env)\"  (or: source $DIR/env.sh)"
}

# ------------------------------------------------------------------------------------------
# down

stop() { # name: TERM, wait up to 10 s, KILL
  local f=$DIR/pids/$1.pid pid comm
  if pid_ok "$1"; then
    read -r pid comm <"$f"
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 25); do pid_ok "$1" || break; sleep 0.2; done
    pid_ok "$1" && kill -KILL "$pid" 2>/dev/null
  fi
  rm -f "$f"
}

teardown() {
  set +e
  local i pid c ids d sock_i
  for name in kueue training-operator jobset trainer coredns; do stop "$name"; done
  for i in $(nodes); do stop "kubelet-$i"; done
  # every pod's containers and sandbox, through each node's containerd
  for i in $(nodes); do
    pid_ok "containerd-$i" || continue
    sock_i=$(sock "$i")
    ids=$(ctr --address "$sock_i" -n k8s.io tasks ls -q 2>/dev/null)
    for c in $ids; do ctr --address "$sock_i" -n k8s.io tasks kill -s SIGKILL "$c" >/dev/null 2>&1; done
    for c in $ids; do
      for _ in $(seq 25); do ctr --address "$sock_i" -n k8s.io tasks delete "$c" >/dev/null 2>&1 && break; sleep 0.2; done
    done
    for c in $(ctr --address "$sock_i" -n k8s.io containers ls -q 2>/dev/null); do
      ctr --address "$sock_i" -n k8s.io containers delete "$c" >/dev/null 2>&1
    done
  done
  local all
  read -ra all <<<"$(daemons | tr '\n' ' ')"
  for ((i = ${#all[@]} - 1; i >= 0; i--)); do stop "${all[i]}"; done
  # shims (and their containers) of these containerds that outlived them
  for pid in $(pgrep -f "containerd-shim-runc-v2 .*-address $DIR/" 2>/dev/null); do
    kill -KILL "$pid" 2>/dev/null
  done
  # mounts under the state dir (pod volumes, netns, overlay rootfs), deepest first
  if [ -d "$DIR" ]; then
    for _ in 1 2 3; do
      awk -v d="$DIR" '$2 == d || index($2, d "/") == 1 {print $2}' /proc/self/mounts | sort -r |
        while read -r m; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null; done
    done
  fi
  awk -v d="$IMAGES" 'index($2, d "/") == 1 {print $2}' /proc/self/mounts | sort -r |
    while read -r m; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null; done
  # the nodes' links, then their namespaces, then the bridge and its routes. A veth goes with its
  # namespace only when the kernel frees that namespace, later and asynchronously (at once only
  # if nothing holds it any more): delete the host ends first, which takes both ends at once
  for d in $(host_veths); do ip link del "$d"; done
  for d in $(ip netns list 2>/dev/null | awk '/^ddpk8s-n[0-9]+/ {print $1}'); do ip netns del "$d"; done
  ip link show "$BRIDGE" >/dev/null 2>&1 && ip link del "$BRIDGE"
  while iptables -D FORWARD -i "$BRIDGE" -o "$BRIDGE" -j ACCEPT -m comment --comment ddpkit-k8s-testbed 2>/dev/null; do :; done
  if grep -q "$MARK" /etc/hosts; then
    rewrite_hosts "$MARK" </dev/null
  fi
  # the kubelets' cgroups (empty once every container is gone), deepest first
  for c in /sys/fs/cgroup/*/"$CGROOT"-n* /sys/fs/cgroup/*/"$CGROOT"; do
    [ -d "$c" ] && find "$c" -depth -type d -exec rmdir {} + 2>/dev/null
  done
  if [ -n "${DDPKIT_K8S_TESTBED_KEEP_LOGS:-}" ] && [ -d "$DIR/log" ]; then
    mkdir -p "$DDPKIT_K8S_TESTBED_KEEP_LOGS" && cp -a "$DIR/log/." "$DDPKIT_K8S_TESTBED_KEEP_LOGS/"
  fi
  rm -rf "$DIR"
  rmdir /etc/kueue 2>/dev/null # Kueue's mount point (cluster.sh kueue), when nothing else uses it
  # Trainer's mount point for its in-cluster token (start_trainer), when nothing else uses it
  rmdir /run/secrets/kubernetes.io/serviceaccount /run/secrets/kubernetes.io /run/secrets 2>/dev/null
  set -e
}

down() {
  teardown
  [ ! -d "$DIR" ] || fail "$DIR still present"
  ! ip link show "$BRIDGE" >/dev/null 2>&1 || fail "bridge $BRIDGE still present"
  ! ip netns list 2>/dev/null | grep -q '^ddpk8s-n' || fail "node network namespaces still present"
  [ -z "$(host_veths)" ] || fail "node links still present: $(host_veths)"
  ! grep -q "$MARK" /etc/hosts || fail "/etc/hosts still has the testbed line"
  [ -z "$(pgrep -f "containerd-shim-runc-v2 .*-address $DIR/")" ] || fail "containerd shims still running"
  log "down (images kept in $IMAGES)"
}

kill_node() { # i: node i dies as a machine does: its link goes first (no goodbye reaches a peer),
  # then its kubelet, containerd, shims and every container process, all SIGKILLed
  local i=${1:-} pid
  if ! [[ $i =~ ^[0-9]+$ ]] || ((i >= NODES)); then fail "kill-node: give a node index 0..$((NODES - 1))"; fi
  healthy || fail "kill-node: the cluster is not up (or a node is already gone)"
  ip link set "ddpk8s-v$i" down
  for name in "kubelet-$i" "containerd-$i"; do
    if pid_ok "$name"; then
      read -r pid _ <"$DIR/pids/$name.pid"
      kill -KILL "$pid"
    fi
  done
  for pid in $(pgrep -f "containerd-shim-runc-v2 .*-address $DIR/node$i/" 2>/dev/null); do
    kill -KILL "$pid" 2>/dev/null
  done
  # the pods' processes: everything in the node's cgroup tree (any v1 hierarchy lists them all)
  local procs
  while IFS= read -r -d '' procs; do
    xargs -r kill -KILL <"$procs" 2>/dev/null || true
  done < <(find /sys/fs/cgroup/pids/"$CGROOT-n$i" /sys/fs/cgroup/memory/"$CGROOT-n$i" -name cgroup.procs -print0 2>/dev/null)
  log "node $(node_name "$i") killed (link down, kubelet, containerd and its containers gone)"
}

revive_node() { # i: a killed node boots again: link up, its containerd and kubelet start on the
  # state they left, the node is Ready with its GPUs advertised, and an out-of-service taint an
  # admin set while it was gone is lifted (what an admin does once the machine is back)
  local i=${1:-} name
  if ! [[ $i =~ ^[0-9]+$ ]] || ((i >= NODES)); then fail "revive-node: give a node index 0..$((NODES - 1))"; fi
  { [ -f "$DIR/nodes" ] && pid_ok kube-apiserver; } || fail "revive-node: the cluster is not up"
  ! pid_ok "kubelet-$i" || fail "revive-node: node $i's kubelet is running (kill-node it first)"
  name=$(node_name "$i")
  trap 'fail "revive-node: command failed (line $LINENO): $BASH_COMMAND"' ERR
  ip link set "ddpk8s-v$i" up
  start_node "$i"
  wait_for 120 "node $name to be Ready again" node_ready "$i"
  kc taint node "$name" node.kubernetes.io/out-of-service- >/dev/null 2>&1 || true
  advertise_gpus "$i"
  trap - ERR
  log "node $name revived"
}

status() {
  if healthy; then
    log "up ($DIR)"
    kc get nodes
    log "use: eval \"\$(ddpkit testbed k8s env)\""
    return 0
  fi
  if stale; then log "broken: partial state present (run down, then up)"; else log "down"; fi
  return 3
}

[ "$(id -u)" = 0 ] || fail "must run as root"
case ${1:-} in
  up | down | status | kueue) "$1" ;;
  kill-node) kill_node "${2:-}" ;;
  revive-node) revive_node "${2:-}" ;;
  fake-nodes) fake_nodes "${2:-}" ;;
  *) fail "usage: cluster.sh up|down|status|kueue|kill-node I|revive-node I|fake-nodes N" ;;
esac
