#!/usr/bin/env bash
# slurm-testbed.sh up|down|status - a throw-away, REAL Slurm cluster on this one machine.
#
#   head  ddpkit-head   netns ddpkit-head   $NET.1    munged + slurmctld, bridge br0
#   node  ddpkit-node1  netns ddpkit-node1  $NET.11   slurmd
#   node  ddpkit-node2  netns ddpkit-node2  $NET.12   slurmd
#
# `node-up NODE` starts a node's slurmd again after a test killed it (a node that rebooted).
#
# Every cluster address exists only inside the network namespaces made here; the root
# namespace gets an "unreachable" route for the subnet, so no packet for it can leave through
# the host's real interfaces. Each daemon also runs in its own UTS namespace, so `hostname`
# differs per node. The filesystem (venv, repository, checkpoints, logs) is the host's.
# No systemd and no cgroup plugins (proctrack/linuxproc, task/none); slurmd 22.05 only needs
# some cgroup filesystem mounted at /sys/fs/cgroup.
#
# Called by `ddpkit testbed slurm up|down|status` (deploy/testbed/slurm.py), which installs
# Debian's slurmctld slurmd slurm-client munge first when they are missing. Needs root.
# Clients must talk from inside the cluster network: `up` writes wrappers for sbatch, srun,
# squeue, scontrol, scancel, ... into $DIR/bin that hop into the head namespace from the root
# namespace and run the real command when already inside a cluster namespace (batch scripts
# and tasks inherit PATH). `source $DIR/env.sh` puts them first on PATH.
#
# Knobs: DDPKIT_SLURM_TESTBED_DIR (/tmp/ddpkit-slurm-testbed)
#        DDPKIT_SLURM_TESTBED_NET (10.251.77: a /24 used only inside the namespaces)
#        DDPKIT_SLURM_TESTBED_CPUS (CPUs each node advertises; default 4, may exceed the host's)
#        DDPKIT_SLURM_TESTBED_KEEP_LOGS=DIR (down: copy the daemon logs there first)
set -Eeuo pipefail

DIR=${DDPKIT_SLURM_TESTBED_DIR:-/tmp/ddpkit-slurm-testbed}
NET=${DDPKIT_SLURM_TESTBED_NET:-10.251.77}
NODE_CPUS=${DDPKIT_SLURM_TESTBED_CPUS:-4}
HEAD=ddpkit-head
NODES=(ddpkit-node1 ddpkit-node2)
MARK="# ddpkit-slurm-testbed"
CONF=$DIR/slurm.conf
SOCK=$DIR/munge/munge.socket.2

ON_FAIL=up_failed  # what wait_for calls on a timeout

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
log() { echo "testbed: $*"; }
fail() { echo "testbed: error: $*" >&2; exit 1; }

node_ip() { case $1 in "$HEAD") echo "$NET.1" ;; *) echo "$NET.1${1##*node}" ;; esac; }
has_ns() { ip netns list 2>/dev/null | grep -q "^$1\( \|$\)"; }

pid_ok() {  # pidfile holds "PID COMM"; alive with that comm and not a zombie?
  local f=$1 pid comm
  [ -f "$f" ] || return 1
  read -r pid comm <"$f" || return 1
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$comm" ] || return 1
  # an exited daemon lingers ~2 s as a zombie until PID 1 reaps it: that counts as dead
  [ "$(cut -d' ' -f3 "/proc/$pid/stat" 2>/dev/null)" != Z ]
}

healthy() {
  pid_ok "$DIR/pids/munged.pid" && pid_ok "$DIR/pids/slurmctld.pid" || return 1
  local n st
  for n in "${NODES[@]}"; do pid_ok "$DIR/pids/slurmd-$n.pid" || return 1; done
  st=$(timeout 10 ip netns exec "$HEAD" env SLURM_CONF="$CONF" sinfo -h -N -o '%N %T' 2>/dev/null) || return 1
  for n in "${NODES[@]}"; do
    grep -Eq "^$n (idle|mixed|allocated|completing)$" <<<"$st" || return 1
  done
}

stale() {  # anything left from an earlier cluster?
  local ns
  [ -d "$DIR" ] && return 0
  for ns in "$HEAD" "${NODES[@]}"; do has_ns "$ns" && return 0; done
  grep -q "$MARK" /etc/hosts && return 0
  ip route show type unreachable | grep -q "^unreachable $NET.0/24" && return 0
  return 1
}

teardown() {
  set +e
  local f pid comm ns ids
  if pid_ok "$DIR/pids/slurmctld.pid"; then
    ids=$(timeout 10 ip netns exec "$HEAD" env SLURM_CONF="$CONF" squeue -h -o %A 2>/dev/null)
    # shellcheck disable=SC2086  # one argument per job id
    [ -n "$ids" ] && timeout 10 ip netns exec "$HEAD" env SLURM_CONF="$CONF" scancel $ids 2>/dev/null
  fi
  for f in "$DIR"/pids/slurmd-*.pid "$DIR/pids/slurmctld.pid" "$DIR/pids/munged.pid"; do
    [ -f "$f" ] || continue
    if pid_ok "$f"; then
      read -r pid comm <"$f"
      kill -TERM "$pid" 2>/dev/null
      for _ in $(seq 50); do pid_ok "$f" || break; sleep 0.2; done
      pid_ok "$f" && kill -KILL "$pid" 2>/dev/null
    fi
    rm -f "$f"
  done
  # whatever still lives in OUR namespaces (slurmstepd, job tasks) was started by this cluster
  for ns in "$HEAD" "${NODES[@]}"; do
    if has_ns "$ns"; then
      for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
    fi
  done
  sleep 0.3
  for ns in "${NODES[@]}" "$HEAD"; do has_ns "$ns" && ip netns del "$ns"; done
  ip route show type unreachable 2>/dev/null | grep -q "^unreachable $NET.0/24" &&
    ip route del unreachable "$NET.0/24"
  if grep -q "$MARK" /etc/hosts; then
    rewrite_hosts "$MARK" </dev/null
  fi
  if [ -n "${DDPKIT_SLURM_TESTBED_KEEP_LOGS:-}" ] && [ -d "$DIR/log" ]; then
    mkdir -p "$DDPKIT_SLURM_TESTBED_KEEP_LOGS" && cp -a "$DIR/log/." "$DDPKIT_SLURM_TESTBED_KEEP_LOGS/"
  fi
  rm -rf "$DIR"
  set -e
}

start_bg() {  # name comm cmd... (setsid does not fork here, so $! is the daemon itself)
  local name=$1 comm=$2
  shift 2
  setsid "$@" </dev/null >>"$DIR/log/$name.out" 2>&1 &
  echo "$! $comm" >"$DIR/pids/$name.pid"
}

wait_for() {  # seconds description cmd...
  local t=$1 what=$2
  shift 2
  local end=$((SECONDS + t))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $end ] || "$ON_FAIL" "timed out after ${t}s waiting for $what"
    sleep 0.2
  done
}

up_failed() {
  trap - ERR
  echo "testbed: error: $*" >&2
  local f
  for f in "$DIR"/log/*.log "$DIR"/log/*.out; do
    [ -s "$f" ] && { echo "---- tail $f" >&2; tail -n 15 "$f" >&2; }
  done
  echo "testbed: removing the partial cluster" >&2
  teardown
  exit 1
}

reach() {  # ns ip: a TCP connect to a closed port must be refused (the host answered)
  local out
  out=$(ip netns exec "$1" timeout 3 bash -c "exec 3<>/dev/tcp/$2/9" 2>&1) && return 0
  grep -q refused <<<"$out"
}

write_conf() {
  local mem n
  mem=$(awk '/^MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
  cat >"$CONF" <<EOF
$MARK (written by ddpkit testbed slurm up)
ClusterName=ddpkit-testbed
SlurmctldHost=$HEAD($(node_ip "$HEAD"))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire=10: otherwise a requeued job waits ~2 minutes before it may run again
AuthInfo=socket=$SOCK,cred_expire=10
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
# debug levels: a failed fault test prints these logs' lines about its job (who signalled a step, when)
SlurmctldDebug=debug
SlurmdDebug=debug2
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
MpiDefault=none
SwitchType=switch/none
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MinJobAge=600
InactiveLimit=0
# Slurm's default is 300 s: a node lost without a word (tests/test_slurm_e2e.py kills one) is
# then DOWN, and its job NODE_FAIL (requeued or not), about 30 s later instead of minutes.
SlurmdTimeout=10
NodeName=DEFAULT CPUs=$NODE_CPUS Sockets=1 CoresPerSocket=$NODE_CPUS ThreadsPerCore=1 RealMemory=$mem State=UNKNOWN
EOF
  for n in "${NODES[@]}"; do
    echo "NodeName=$n NodeAddr=$(node_ip "$n") NodeHostname=$n" >>"$CONF"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >>"$CONF"
}

write_wrappers() {
  local c
  # Jobs inherit PATH: inside a cluster namespace run the real client right there (as on a
  # real cluster); from the root namespace hop into the head's network first.
  for c in sbatch srun salloc sinfo squeue scontrol scancel sacct sattach sstat sprio sshare sdiag sbcast strigger; do
    cat >"$DIR/bin/$c" <<EOF
#!/bin/sh
export SLURM_CONF=$CONF
case "\$(ip netns identify \$\$ 2>/dev/null)" in
  $HEAD|$(IFS='|'; echo "${NODES[*]}")) exec /usr/bin/$c "\$@" ;;
esac
exec ip netns exec $HEAD /usr/bin/$c "\$@"
EOF
  done
  cat >"$DIR/bin/testbed-node" <<EOF
#!/bin/sh
# testbed-node NODE CMD...: run a command inside a node's network and hostname namespaces
n=\$1; shift
read -r pid comm <"$DIR/pids/slurmd-\$n.pid" || exit 1
exec nsenter -t "\$pid" -n -u -- "\$@"
EOF
  chmod +x "$DIR"/bin/*
  echo "export PATH=$DIR/bin:\$PATH" >"$DIR/env.sh"
}

start_slurmd() {  # node
  log "slurmd in $1"
  start_bg "slurmd-$1" slurmd nsenter --net="/run/netns/$1" unshare --uts /bin/sh -c \
    "hostname $1 && exec slurmd -D -N $1 -f $CONF"
}

wait_idle() {  # node
  wait_for 45 "node $1 to be idle" bash -c \
    "SLURM_CONF=$CONF ip netns exec $HEAD sinfo -h -N -n $1 -o %T | grep -Eq '^(idle|mixed|allocated)$'"
}

node_up() {  # node: start a node's slurmd again after a fault test killed it (a node reboot)
  local n=$1
  printf '%s\n' "${NODES[@]}" | grep -qx "$n" || fail "no node $n (nodes: ${NODES[*]})"
  pid_ok "$DIR/pids/slurmctld.pid" || fail "the cluster is not up"
  ON_FAIL=fail  # a node that does not come back leaves the rest of the cluster as it is
  pid_ok "$DIR/pids/slurmd-$n.pid" || start_slurmd "$n"
  # ReturnToService=2: a DOWN node whose slurmd registers again is usable at once
  wait_idle "$n"
  log "node $n is up"
}

up() {
  local t0=$SECONDS n m hosts
  if healthy; then
    log "already up ($DIR)"
    log "use: source $DIR/env.sh"
    return 0
  fi
  if stale; then
    log "found a stale or partial cluster: removing it first"
    teardown
  fi
  ip -4 addr show | grep -q "inet $NET\." && fail "subnet $NET.0/24 is already used on this host; set DDPKIT_SLURM_TESTBED_NET"
  [ -z "$(ip route show "$NET.0/24")" ] || fail "a route for $NET.0/24 already exists; set DDPKIT_SLURM_TESTBED_NET"
  trap 'up_failed "command failed (line $LINENO): $BASH_COMMAND"' ERR

  mkdir -p "$DIR"/{pids,log,run,ctld,bin,munge,munge-key}
  chmod 755 "$DIR" "$DIR/munge"
  chmod 700 "$DIR/munge-key"
  for n in "${NODES[@]}"; do mkdir -p "$DIR/spool/$n"; done

  log "network namespaces $HEAD ${NODES[*]} on $NET.0/24 (unreachable from the root namespace)"
  ip route add unreachable "$NET.0/24"
  for n in "$HEAD" "${NODES[@]}"; do
    ip netns add "$n"
    ip -n "$n" link set lo up
  done
  ip -n "$HEAD" link add br0 type bridge
  ip -n "$HEAD" addr add "$(node_ip "$HEAD")/24" dev br0
  ip -n "$HEAD" link set br0 up
  for n in "${NODES[@]}"; do
    ip -n "$HEAD" link add "v-$n" type veth peer name eth0 netns "$n"
    ip -n "$HEAD" link set "v-$n" master br0 up
    ip -n "$n" addr add "$(node_ip "$n")/24" dev eth0
    ip -n "$n" link set eth0 up
  done
  for n in "$HEAD" "${NODES[@]}"; do echo "$(node_ip "$n") $n $MARK"; done | rewrite_hosts "$MARK"
  for n in "${NODES[@]}"; do
    reach "$n" "$(node_ip "$HEAD")" || up_failed "no connectivity $n -> $HEAD"
    for m in "${NODES[@]}"; do reach "$n" "$(node_ip "$m")" || up_failed "no connectivity $n -> $m"; done
  done

  log "munged (own key and socket)"
  dd if=/dev/urandom of="$DIR/munge-key/munge.key" bs=1024 count=1 status=none
  chmod 400 "$DIR/munge-key/munge.key"
  start_bg munged munged munged --foreground --force --socket="$SOCK" \
    --key-file="$DIR/munge-key/munge.key" --log-file="$DIR/log/munged.log" \
    --pid-file="$DIR/run/munged.pid" --seed-file="$DIR/run/munged.seed"
  wait_for 15 "the munge socket" bash -c "munge -n -S '$SOCK' | unmunge -S '$SOCK'"

  write_conf
  # nsenter --net, NOT `ip netns exec`: the latter remounts /sys, which hides /sys/fs/cgroup,
  # and slurmd 22.05 then refuses to start ("Unable to initialize cgroup plugin").
  log "slurmctld in $HEAD"
  start_bg slurmctld slurmctld nsenter --net="/run/netns/$HEAD" unshare --uts /bin/sh -c \
    "hostname $HEAD && exec slurmctld -D -c -f $CONF"
  wait_for 30 "slurmctld to answer" bash -c "SLURM_CONF=$CONF ip netns exec $HEAD scontrol ping | grep -q 'is UP'"
  for n in "${NODES[@]}"; do start_slurmd "$n"; done
  for n in "${NODES[@]}"; do wait_idle "$n"; done
  write_wrappers

  # self-test through the wrappers: both nodes must answer, with distinct hostnames
  hosts=$(timeout 30 "$DIR/bin/srun" -N2 -t 1 hostname | sort -u | tr '\n' ' ') ||
    up_failed "srun -N2 hostname failed"
  [ "$hosts" = "$(printf '%s ' "${NODES[@]}")" ] || up_failed "srun -N2 hostname printed '$hosts'"
  trap - ERR
  "$DIR/bin/sinfo"
  log "up in $((SECONDS - t0)) s; srun -N2 hostname: $hosts"
  log "use: source $DIR/env.sh"
}

down() {
  teardown
  local left="" ns
  for ns in "$HEAD" "${NODES[@]}"; do has_ns "$ns" && left="$left $ns"; done
  [ -z "$left" ] || fail "namespaces still present:$left"
  [ ! -d "$DIR" ] || fail "$DIR still present"
  ! grep -q "$MARK" /etc/hosts || fail "/etc/hosts still has testbed lines"
  log "down"
}

status() {
  if healthy; then
    log "up ($DIR)"
    "$DIR/bin/sinfo" -N -o '%N %T %c %m'
    log "use: source $DIR/env.sh"
    return 0
  fi
  if stale; then log "broken: partial state present (run down, then up)"; else log "down"; fi
  return 3
}

[ "$(id -u)" = 0 ] || fail "must run as root"
case ${1:-} in
  node-up)
    [ $# = 2 ] || fail "usage: slurm-testbed.sh node-up NODE"
    node_up "$2"
    ;;
  up | down | status)
    if [ "$1" = up ]; then
      for b in slurmctld slurmd munged munge unmunge sinfo scontrol ip unshare nsenter setsid timeout; do
        command -v "$b" >/dev/null || fail "missing command $b (apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge)"
      done
    fi
    "$1"
    ;;
  *) fail "usage: slurm-testbed.sh up|down|status|node-up NODE" ;;
esac
