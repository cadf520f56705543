#!/usr/bin/env bash
# Build the Kubernetes testbed's Go binaries from their published Go modules, once per version.
#
#   bash k8s/testbed/build.sh            # the cluster's components; prints the cache's bin dir last
#   bash k8s/testbed/build.sh kueue kwok # ... and then the extras: Kueue (`testbed k8s up --kueue`),
#   DDPKIT_K8S_EXTRAS="kueue kwok" bash k8s/testbed/build.sh   #  kwok (fake nodes)
#   bash k8s/testbed/build.sh --wait     # waits for a running build.sh (both phases), builds nothing
#
# Everything lands in $DDPKIT_K8S_CACHE/<component>-<version>/ (default /var/cache/ddpkit/k8s),
# outside the clone, so a later clone (and CI on the same machine) reuses an earlier build.
# Each component has its own stamp: an interrupted build resumes with the next component.
# Two phases, each under its own lock on the cache: the cluster's components, then the extras. A
# build.sh that needs only the cluster waits for a running build's first phase, not its extras:
# on a cold CI machine the Kubernetes tests start while Kueue and kwok still compile (~6 min).
# DDPKIT_K8S_EXTRAS_NICE=N: the extras phase runs at niceness N (CI: 19, the cluster's at 0).
set -euo pipefail

KUBERNETES_VERSION=${KUBERNETES_VERSION:-1.34.10}
ETCD_VERSION=${ETCD_VERSION:-3.6.14}
CONTAINERD_VERSION=${CONTAINERD_VERSION:-2.1.6}
COREDNS_VERSION=${COREDNS_VERSION:-1.14.7}
TRAINING_OPERATOR_VERSION=${TRAINING_OPERATOR_VERSION:-1.9.3}
JOBSET_VERSION=${JOBSET_VERSION:-0.12.0}
TRAINER_VERSION=${TRAINER_VERSION:-2.3.0}
KUEUE_VERSION=${KUEUE_VERSION:-0.18.4}   # README: "Kueue and kwok"
KWOK_VERSION=${KWOK_VERSION:-0.8.0}

# Extras, built after the controllers when asked for (env or arguments), in this order
read -ra asked <<< "${DDPKIT_K8S_EXTRAS:-} $*"
EXTRAS=() WAIT_ONLY=0
for x in "${asked[@]}"; do
  case $x in
    kueue|kwok) [[ " ${EXTRAS[*]} " == *" $x "* ]] || EXTRAS+=("$x") ;;
    --wait) WAIT_ONLY=1 ;;
    *) echo "build.sh: unknown extra '$x' (known: kueue kwok, or --wait)" >&2; exit 2 ;;
  esac
done

CACHE=${DDPKIT_K8S_CACHE:-/var/cache/ddpkit/k8s}
export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=${CGO_ENABLED:-0}
# One Go build cache for every component: the k8s libraries they share compile once.
export GOCACHE=${GOCACHE:-$CACHE/go-build}
mkdir -p "$CACHE/bin"

log() { printf '[k8s-build %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

# cpu_between BEFORE AFTER: the CPU-seconds (user + sys) of this shell's children that ended
# between two `times > FILE` (bash's `times`, written by this shell: a subshell's are its own)
cpu_between() {
  awk 'FNR == 2 {split($1, u, /[ms]/); split($2, s, /[ms]/); t[++n] = u[1] * 60 + u[2] + s[1] * 60 + s[2]}
       END {printf "%.0f", t[2] - t[1]}' "$1" "$2"
}

# build NAME VERSION FUNCTION: run FUNCTION in a scratch module dir unless NAME-VERSION is built.
build() {
  local name=$1 version=$2 fn=$3 dir="$CACHE/$1-$2" started=$SECONDS cpu
  if [[ -f $dir/.done ]]; then log "$name $version: cached"; return; fi
  rm -rf "$dir"; mkdir -p "$dir/bin" "$dir/src"
  log "$name $version: building"
  times > "$dir/.times-before"
  ( cd "$dir/src" && "$fn" "$version" "$dir/bin" )
  times > "$dir/.times-after"
  cpu=$(cpu_between "$dir/.times-before" "$dir/.times-after")
  rm "$dir/.times-before" "$dir/.times-after"
  echo "$((SECONDS - started))" > "$dir/.seconds"
  echo "$cpu" > "$dir/.cpu-seconds"
  touch "$dir/.done"
  log "$name $version: built in $((SECONDS - started)) s, $cpu CPU-seconds"
}

# A wrapper module: k8s.io/kubernetes maps its staging modules with local replaces, which
# `go install pkg@version` refuses, so require it here and point each staging module at its
# published v0.<minor>.<patch> tag instead.
kubernetes() {
  local v=$1 out=$2 mod staging
  go mod init ddpkit.local/k8s-testbed >/dev/null 2>&1
  go mod edit -go=1.24.0 -require="k8s.io/kubernetes@v$v"
  mod=$(go mod download -json "k8s.io/kubernetes@v$v" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
  staging=$(sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/src/.*#\1#p' "$mod")
  for m in $staging; do go mod edit -replace="$m=$m@v0.${v#1.}"; done
  printf 'godebug default=go1.24\n' >> go.mod
  cat > tools.go <<'EOF'
//go:build tools

package tools
EOF
  go get "k8s.io/kubernetes/cmd/kube-apiserver@v$v" "k8s.io/kubernetes/cmd/kubelet@v$v" \
    "k8s.io/kubernetes/cmd/kube-controller-manager@v$v" "k8s.io/kubernetes/cmd/kube-scheduler@v$v" \
    "k8s.io/kubernetes/cmd/kubectl@v$v" >/dev/null 2>&1 || true
  local major=${v%%.*} minor=${v#*.}; minor=${minor%%.*} ld="-s -w"
  for p in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
    ld+=" -X $p.gitVersion=v$v -X $p.gitMajor=$major -X $p.gitMinor=$minor"
    ld+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  # one go build for all five: their shared packages compile once
  go build -trimpath -tags selinux,notest -ldflags "$ld" -o "$out/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kubectl
  # the sandbox ("pause") image's binary, from the same release's source
  local src; src=$(go list -m -f '{{.Dir}}' k8s.io/kubernetes)
  gcc -Os -Wall -Werror -static -DVERSION="v$v" -o "$out/pause" "$src/build/pause/linux/pause.c"
}

etcd() {   # server/v3's go.mod replaces its siblings with ../ paths: wrap it too
  local v=$1 out=$2
  go mod init ddpkit.local/etcd >/dev/null 2>&1
  go mod edit -require="go.etcd.io/etcd/server/v3@v$v"
  go get "go.etcd.io/etcd/server/v3@v$v" >/dev/null
  go build -trimpath -ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=v$v" \
    -o "$out/etcd" go.etcd.io/etcd/server/v3
}

containerd() {   # its go.mod has exclude directives, which `go install pkg@version` refuses: wrap it
  local v=$1 out=$2 p=github.com/containerd/containerd/v2 mod e
  go mod init ddpkit.local/containerd >/dev/null 2>&1
  mod=$(go mod download -json "$p@v$v" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
  sed -n '/^exclude (/,/^)/s#^[[:space:]]*\([a-z][^ ]*\) \(v[^ ]*\)$#\1@\2#p' "$mod" |
    while read -r e; do go mod edit -exclude="$e"; done
  go get "$p/cmd/containerd@v$v" "$p/cmd/containerd-shim-runc-v2@v$v" "$p/cmd/ctr@v$v" >/dev/null
  go build -trimpath -tags no_btrfs,no_devmapper,no_zfs -ldflags "-s -w -X $p/version.Version=v$v" \
    -o "$out/" "$p/cmd/containerd" "$p/cmd/containerd-shim-runc-v2" "$p/cmd/ctr"
}

# copy_manifests MODULE@VERSION OUT NAME DIR...: the controller's own upstream manifests (CRDs,
# RBAC, webhook configurations, kustomizations) in <component>/manifests/NAME, for cluster.sh
copy_manifests() {
  local src; src=$(go mod download -json "$1" | sed -n 's/.*"Dir": "\(.*\)",*/\1/p')
  local out=$2/../manifests/$3 d; shift 3
  for d in "$@"; do mkdir -p "$out/$(dirname "$d")"; cp -r "$src/$d" "$out/$d"; done
  chmod -R u+w "$out"
}

training_operator() {   # k8s.io v0.31 / controller-runtime v0.19: nothing to share, built alone
  GOBIN=$2 go install -trimpath -ldflags "-s -w" \
    "github.com/kubeflow/training-operator/cmd/training-operator.v1@v$1"
  copy_manifests "github.com/kubeflow/training-operator@v$1" "$2" . manifests
}

# Trainer, JobSet and CoreDNS in one wrapper module and one `go build`: Trainer requires exactly
# this JobSet, both sit on k8s.io v0.36 / controller-runtime v0.24, and CoreDNS's kubernetes
# plugin (k8s.io v0.35 in its go.mod) takes the same client-go by minimal version selection, so
# the libraries they share (most of their code) compile once instead of three times. CoreDNS
# is its coremain with only the plugins the testbed's Corefile uses (cluster.sh writes it):
# upstream's main imports every plugin, with the cloud SDKs behind them. The JobSet main builds
# from the wrapper, which also avoids `go install sigs.k8s.io/jobset@v`'s version-list query
# (the module proxy here refuses it: 403).
controllers() {
  local out=$2
  go mod init ddpkit.local/k8s-controllers >/dev/null 2>&1
  go mod edit -go=1.26.0
  mkdir -p coredns
  cat > coredns/main.go <<'EOF'
// CoreDNS with the plugins of the testbed's Corefile (k8s/testbed/cluster.sh) and no others.
package main

import (
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/template"
)

func main() { coremain.Run() }
EOF
  # no `go mod tidy`: it would drop the two commands' modules, which no package here imports
  go get "${CONTROLLER_MODULES[@]}" >/dev/null
  go build -trimpath -ldflags "-s -w -X github.com/coredns/coredns/coremain.GitCommit=v$COREDNS_VERSION" \
    -o "$out/" "github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager" \
    "sigs.k8s.io/jobset" ./coredns
  copy_manifests "github.com/kubeflow/trainer/v2@v$TRAINER_VERSION" "$out" trainer manifests
  copy_manifests "sigs.k8s.io/jobset@v$JOBSET_VERSION" "$out" jobset config
}

# The controllers wrapper's top-level requirements, also required first by the extras' wrappers.
# Kueue's module is one of them although this phase builds none of its packages: minimal version
# selection then gives the controllers the newer k8s.io/utils, kube-openapi, apiextensions and
# go-openapi that Kueue requires, so the k8s.io libraries under everything (client-go,
# apimachinery, controller-runtime, ...) compile once, at those versions, and Kueue's build in
# the extras phase finds them in Go's build cache. The controllers' versions are the same with
# or without the extras; the cluster's phase only downloads Kueue's module.
CONTROLLER_MODULES=("github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager@v$TRAINER_VERSION"
  "sigs.k8s.io/jobset@v$JOBSET_VERSION" "github.com/coredns/coredns@v$COREDNS_VERSION"
  "sigs.k8s.io/kueue@v$KUEUE_VERSION")

# next_to_controllers NAME MODULE@VERSION...: a wrapper module that requires the controllers'
# modules at the controllers' versions plus the given ones, so minimal version selection keeps
# the controllers' library versions wherever the new module does not require newer ones, and
# the Go build cache already holds those packages compiled (kwok needs nothing newer: it
# compiles only its own packages). The controllers' own build and cache key stay as they are.
next_to_controllers() {
  go mod init "ddpkit.local/$1" >/dev/null 2>&1; shift
  go mod edit -go=1.26.0
  go get "${CONTROLLER_MODULES[@]}" "$@" >/dev/null
}

# origin MODULE@VERSION: "<commit> <time>" of the tag, as the Go module proxy protocol's .info
# records them (the commit may be absent)
origin() {
  go list -m -f '{{with .Origin}}{{.Hash}}{{end}} {{with .Time}}{{.UTC.Format "2006-01-02T15:04:05Z"}}{{end}}' "$1"
}

# Kueue's manager, built against the Trainer and JobSet API types the testbed runs (MVS lifts
# Kueue 0.18.4's trainer v2.2.1 to v2.3.0: upstream's "Trainer v2.2 and v2.3 don't have API
# compatibility"). The libraries it shares with the controllers are at the same versions
# (CONTROLLER_MODULES requires Kueue's module), so only its own packages and k8s.io/apiserver's
# compile here.
kueue() {
  local v=$KUEUE_VERSION out=$2 m=sigs.k8s.io/kueue p=sigs.k8s.io/kueue/pkg/version commit date
  next_to_controllers kueue "$m@v$v"
  read -r commit date <<< "$(origin "$m@v$v")"   # upstream's BuildDate: the build's date
  local ld="-s -w -X $p.GitVersion=v$v -X $p.GitCommit=$commit -X $p.BuildDate=$date"
  go build -trimpath -ldflags "$ld" -o "$out/kueue" "$m/cmd/kueue"
  copy_manifests "$m@v$v" "$out" kueue config/components config/default
}

# kwok (fake nodes): only the `kwok` controller, not kwokctl (which makes whole fake clusters).
# v0.8 has no built-in Stages: without --config stages it exits "no stages found". Its
# kustomize/ tree is copied, and the fast stages (node-initialize, node-heartbeat-with-lease,
# pod-ready/-complete/-delete) rendered into stage-fast.yaml for `kwok --config`.
kwok() {
  local v=$1 out=$2 m=sigs.k8s.io/kwok
  next_to_controllers kwok "$m@v$v"
  go build -trimpath -ldflags "-s -w -X $m/pkg/consts.Version=v$v" -o "$out/kwok" "$m/cmd/kwok"
  copy_manifests "$m@v$v" "$out" kwok kustomize
  "$CACHE/kubernetes-$KUBERNETES_VERSION/bin/kubectl" kustomize "$out/../manifests/kwok/kustomize/stage/fast" \
    > "$out/../manifests/kwok/stage-fast.yaml"
}

# Locks: .build.lock for the cluster's components, .extras.lock for the extras. A build with
# extras takes the second before it lets the first go, so a build.sh that took the first after it
# (`--wait`, or `build.sh kueue`) finds the extras' lock held until they are built.
take_lock() {   # FD FILE WHAT
  eval "exec $1>\"\$CACHE/$2\""
  if ! flock -n "$1"; then
    log "another build.sh is building $3 into $CACHE: waiting for it to finish"
    flock "$1"
  fi
}
take_lock 9 .build.lock "the cluster's components"
if (( WAIT_ONLY )); then exec 9>&-; take_lock 8 .extras.lock "the extras"; exit 0; fi

# link DIR...: $CACHE/bin/<binary> and $CACHE/manifests/<controller> -> the built component's
link() {
  mkdir -p "$CACHE/manifests"
  for d in "$@"; do
    ln -sf "$CACHE/$d/bin/"* "$CACHE/bin/"
    case $d in
      training-operator-*) ln -sfn "$CACHE/$d/manifests" "$CACHE/manifests/training-operator" ;;
      controllers-*) for m in trainer jobset; do ln -sfn "$CACHE/$d/manifests/$m" "$CACHE/manifests/$m"; done ;;
      kueue-*|kwok-*) ln -sfn "$CACHE/$d/manifests/${d%%-*}" "$CACHE/manifests/${d%%-*}" ;;
    esac
  done
}

start=$SECONDS
CONTROLLERS=trainer$TRAINER_VERSION-jobset$JOBSET_VERSION-coredns$COREDNS_VERSION-kueue$KUEUE_VERSION
KUEUE_DIR=kueue-$KUEUE_VERSION-trainer$TRAINER_VERSION-jobset$JOBSET_VERSION
COMPONENTS=("kubernetes-$KUBERNETES_VERSION" "etcd-$ETCD_VERSION" "containerd-$CONTAINERD_VERSION"
  "training-operator-$TRAINING_OPERATOR_VERSION" "controllers-$CONTROLLERS")
# Two chains at once: Kubernetes (~850 CPU-seconds, with long stretches that keep one CPU busy:
# its biggest packages, then five links) beside the others (etcd, containerd, training-operator,
# the controllers: ~650). They share no library versions, so nothing compiles twice but some of
# Go's standard library; on a busy CI machine the two chains take the CPU the tests would (the
# cluster's build is the critical path of a cold run). Each chain is its own subshell, so each
# component's CPU-seconds (`times`) are its own.
( build kubernetes "$KUBERNETES_VERSION" kubernetes ) & kubernetes_chain=$!
( build etcd "$ETCD_VERSION" etcd
  build containerd "$CONTAINERD_VERSION" containerd
  build training-operator "$TRAINING_OPERATOR_VERSION" training_operator
  build controllers "$CONTROLLERS" controllers ) & others_chain=$!
failed=0
wait "$kubernetes_chain" || failed=$?
wait "$others_chain" || failed=$?
(( failed == 0 )) || { log "a component failed to build (exit $failed): see above"; exit "$failed"; }
link "${COMPONENTS[@]}"
if (( ${#EXTRAS[@]} )); then
  take_lock 8 .extras.lock "the extras"
  exec 9>&-   # the cluster's components are built: a build.sh that needs only them goes on
  # CI: the extras compile beside the Kubernetes tests, which should not wait on the CPU for them
  [[ -z ${DDPKIT_K8S_EXTRAS_NICE:-} ]] || renice -n "$DDPKIT_K8S_EXTRAS_NICE" -p $$ >/dev/null
  for x in "${EXTRAS[@]}"; do   # after the controllers: they reuse the controllers' compiled packages
    case $x in
      kueue) build kueue "${KUEUE_DIR#kueue-}" kueue; link "$KUEUE_DIR" ;;
      kwok) build kwok "$KWOK_VERSION" kwok; link "kwok-$KWOK_VERSION" ;;
    esac
  done
fi
# what bench/k8s_testbed.py reports: the pinned components built so far
for d in "${COMPONENTS[@]}" "$KUEUE_DIR" "kwok-$KWOK_VERSION"; do
  [[ -f $CACHE/$d/.done ]] && echo "$d"
done > "$CACHE/components.$$"
mv "$CACHE/components.$$" "$CACHE/components"
log "all built or cached in $((SECONDS - start)) s; $(du -sh "$CACHE" --exclude=go-build | cut -f1) of binaries"
echo "$CACHE/bin"
