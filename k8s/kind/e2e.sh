#!/usr/bin/env bash
# End-to-end check of every Kubernetes flavor on a local kind cluster.
#
# Needs: docker, kind, kubectl, network access (operator manifests), and ddpkit installed
# (or run from the repository root). Creates a cluster (kept with KEEP=1), builds and loads the
# image, installs the operators at pinned releases, then for each flavor: renders the job with
# `ddpkit render k8s`, lints it against the CRDs the cluster serves, applies it with strict
# server-side field validation, waits for SUCCEEDED with `ddpkit status`, prints rank 0's log
# and cancels it. Nothing here is hand-written YAML: every manifest comes from `ddpkit render`.
#
#   k8s/kind/e2e.sh                       # job pytorchjob jobset trainjob
#   FLAVORS="job" k8s/kind/e2e.sh         # the zero-operator path only
#   CLUSTER=existing IMAGE=ddpkit:0.1 k8s/kind/e2e.sh
#       # any cluster your kubeconfig points at (e.g. `ddpkit testbed k8s`), with the operators
#       # installed and IMAGE already on its nodes: no kind, no docker, no installs
# EXTRA_SETS="--set resources.cpus_per_node=0.5" adds overrides to every render.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CLUSTER="${CLUSTER:-ddpkit-e2e}"
IMAGE="${IMAGE:-ddpkit:e2e}"
JOB_FILE="${JOB_FILE:-$REPO/examples/quickstart-2node.yaml}"
FLAVORS="${FLAVORS:-job pytorchjob jobset trainjob}"
NAMESPACE="${NAMESPACE:-default}"
TIMEOUT_S="${TIMEOUT_S:-900}"
KEEP="${KEEP:-0}"
# Pinned releases (the CRDs ddpkit's tests lint against are from the same tags).
TRAINING_OPERATOR_REF="${TRAINING_OPERATOR_REF:-v1.9.0}"
JOBSET_REF="${JOBSET_REF:-v0.12.0}"
TRAINER_REF="${TRAINER_REF:-v2.3.0}"
OUT="${OUT:-$(mktemp -d)}"

if command -v ddpkit >/dev/null 2>&1; then
  DDPKIT=(ddpkit)
else
  DDPKIT=(python3 -m deploy)
fi

log() { printf '==> %s\n' "$*" >&2; }
die() { printf 'e2e: %s\n' "$*" >&2; exit 1; }
# `command`: with ddpkit on PATH, DDPKIT=(ddpkit) would otherwise call this function again
ddpkit() { (cd "$REPO" && command "${DDPKIT[@]}" "$@"); }

EXISTING=0
[[ "$CLUSTER" == existing ]] && EXISTING=1
if (( EXISTING )); then
  command -v kubectl >/dev/null 2>&1 || die "kubectl is not installed"
  kubectl version >/dev/null || die "kubectl cannot reach the cluster (check KUBECONFIG)"
else
  for tool in docker kind kubectl; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool is not installed (this check needs docker, kind and kubectl)"
  done
fi

cleanup() {
  if [[ "$KEEP" != 1 ]] && (( ! EXISTING )); then
    log "deleting kind cluster $CLUSTER (KEEP=1 keeps it)"
    kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT

wants() { [[ " $FLAVORS " == *" $1 "* ]]; }

if (( EXISTING )); then
  log "using the cluster of the current kubeconfig context; $IMAGE must be on its nodes"
else
if ! kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  log "creating kind cluster $CLUSTER"
  kind create cluster --name "$CLUSTER" --config "$HERE/cluster.yaml" --wait 180s
fi
kubectl config use-context "kind-$CLUSTER" >/dev/null

log "building $IMAGE and loading it into the cluster"
# the project's Dockerfile through `ddpkit image build` (BuildKit on; BASE_IMAGE=... for a
# local base, e.g. on a machine that cannot pull the official PyTorch image)
ddpkit image build --tag "$IMAGE" ${BASE_IMAGE:+--base-image "$BASE_IMAGE"}
kind load docker-image "$IMAGE" --name "$CLUSTER"

if wants pytorchjob; then
  log "installing the Kubeflow training operator $TRAINING_OPERATOR_REF"
  kubectl apply --server-side -k "github.com/kubeflow/training-operator.git/manifests/overlays/standalone?ref=$TRAINING_OPERATOR_REF"
  kubectl -n kubeflow rollout status deployment/training-operator --timeout=300s
fi
if wants trainjob; then
  log "installing Kubeflow Trainer $TRAINER_REF (brings its own JobSet) and its runtimes"
  kubectl apply --server-side -k "github.com/kubeflow/trainer.git/manifests/overlays/manager?ref=$TRAINER_REF"
  kubectl -n kubeflow-system wait --for=condition=Available deployment --all --timeout=300s
  kubectl apply --server-side -k "github.com/kubeflow/trainer.git/manifests/overlays/runtimes?ref=$TRAINER_REF"
elif wants jobset; then
  log "installing JobSet $JOBSET_REF"
  kubectl apply --server-side -f "https://github.com/kubernetes-sigs/jobset/releases/download/$JOBSET_REF/manifests.yaml"
  kubectl -n jobset-system wait --for=condition=Available deployment --all --timeout=300s
fi
fi  # EXISTING

log "saving the CRDs this cluster serves to $OUT/crds"
mkdir -p "$OUT/crds"
for crd in pytorchjobs.kubeflow.org trainjobs.trainer.kubeflow.org jobsets.jobset.x-k8s.io; do
  if kubectl get crd "$crd" >/dev/null 2>&1; then
    kubectl get crd "$crd" -o yaml >"$OUT/crds/$crd.yaml"
  fi
done

# A small CPU job that fits on a laptop's kind nodes.
SETS=(--set "image=$IMAGE" --set "k8s.namespace=$NAMESPACE"
      --set "resources.cpus_per_node=0.5" --set "resources.memory=2Gi" --set "resources.shm=256Mi")
# shellcheck disable=SC2206  # EXTRA_SETS is a list of words by design
SETS+=(${EXTRA_SETS:-})

failed=()
for flavor in $FLAVORS; do
  name="e2e-$flavor"
  manifest="$OUT/$flavor.yaml"
  handle="k8s://$NAMESPACE/$flavor/$name"
  log "[$flavor] render, lint, apply"
  ddpkit render k8s "$JOB_FILE" --flavor "$flavor" --set "name=$name" "${SETS[@]}" -o "$manifest"
  ddpkit lint "$manifest" --crds "$OUT/crds"
  kubectl apply --validate=strict --server-side -f "$manifest"

  log "[$flavor] waiting for $handle (at most ${TIMEOUT_S}s)"
  state=PENDING
  deadline=$((SECONDS + TIMEOUT_S))
  while (( SECONDS < deadline )); do
    line="$(ddpkit status "$handle")" || line=UNKNOWN
    state="${line%% *}"  # the first word is the state; progress follows it
    [[ "$state" == SUCCEEDED || "$state" == FAILED ]] && break
    sleep 5
  done
  log "[$flavor] $state; rank 0's log (tail):"
  ddpkit logs "$handle" --rank 0 | tail -n 20 || true
  ddpkit cancel "$handle" >/dev/null || true
  [[ "$state" == SUCCEEDED ]] || failed+=("$flavor:$state")
done

if (( ${#failed[@]} )); then
  die "flavors that did not succeed: ${failed[*]} (manifests in $OUT)"
fi
log "every flavor succeeded: $FLAVORS"
