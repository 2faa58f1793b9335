#!/usr/bin/env bash
# A real, private, single-node Slurm on this machine, for the kit's tests and for trying the
# Slurm launcher without a cluster. Debian's slurm-wlm + munge; root only.
#
#   cluster/slurm/local-slurm.sh start    install if needed, start munged/slurmctld/slurmd, wait
#                                         until the node is idle (seconds when already running)
#   cluster/slurm/local-slurm.sh status   one line; exit 0 when running and answering
#   cluster/slurm/local-slurm.sh stop     cancel every job, stop the daemons this script started
#
# Exit codes: 0 done; 1 failed (see the message and the logs it names); 2 usage;
#             3 Slurm cannot run here (not root, no apt-get, install failed, or someone else's
#               Slurm configuration is present) — tests skip with the reason printed.
#
# The node is declared with at least 4 CPUs (slurmd trusts the configuration, SlurmdParameters=
# config_overrides) so 4 ranks fit on a 2-core laptop, as with mpiexec; MpiDefault=pmi2 is what
# MPICH (the `mpich` wheel, MVAPICH2, Intel MPI) speaks under srun. Like a real cluster's, it binds
# tasks to their CPUs when asked (TaskPlugin=task/affinity: --cpus-per-task and --cpu-bind=cores
# show in each rank's affinity; no binding by default, as 4 CPUs are declared on 2) and has two stand-in GPUs (Gres=gpu:2 whose device files are null devices under
# /run/hpdl-local-slurm), so jobs and steps can ask for --gpus-per-task as on a GPU cluster.
set -uo pipefail
export PATH="/usr/sbin:/sbin:/usr/bin:/bin:$PATH" LC_ALL=C

CONF_DIR=/etc/slurm
CONF="$CONF_DIR/slurm.conf"
GRES_CONF="$CONF_DIR/gres.conf"
MARK="# hpdl local-slurm: written by cluster/slurm/local-slurm.sh"
RUN=/run/hpdl-local-slurm
LOGS=/var/log/slurm
NODE="$(hostname -s)"
CPUS="$(nproc)"; [ "$CPUS" -lt 4 ] && CPUS=4
GPUS=2  # stand-ins, not real: see above
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 8 / 10 ))
[ "$MEM_MB" -gt 4000 ] && MEM_MB=4000

say()  { echo "local-slurm: $*" >&2; }
detached() {  # start a daemon without the caller's open files: a lock held by whoever ran this
  (             # script (`flock LOCK cluster/slurm/local-slurm.sh start`) must not live on in it
    for fd in /proc/self/fd/*; do
      fd=${fd##*/}; [ "$fd" -gt 2 ] 2>/dev/null && eval "exec $fd>&-" 2>/dev/null
    done
    exec "$@" </dev/null
  )
}
unavailable() { echo "local-slurm: unavailable: $*" >&2; exit 3; }
fail() { echo "local-slurm: failed: $*" >&2; exit 1; }

pid_alive() {  # pidfile: the process exists and is not a zombie (readable by any user)
  local pid; pid=$(cat "$1" 2>/dev/null) && [ -n "$pid" ] && [ -r "/proc/$pid/stat" ] || return 1
  [ "$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -c1)" != Z ]
}

node_state() { timeout 10 sinfo -h -n "$NODE" -o %T 2>/dev/null | head -n1; }

running() {
  pid_alive /run/slurmctld.pid && pid_alive /run/slurmd.pid || return 1
  case "$(node_state)" in idle*|mix*|alloc*|completing*) return 0 ;; *) return 1 ;; esac
}

installed() {
  local c
  for c in slurmctld slurmd srun sbatch squeue scancel sinfo munged munge; do
    command -v "$c" >/dev/null || return 1
  done
}

install() {
  installed && return 0
  [ "$(id -u)" = 0 ] || unavailable "Slurm is not installed and installing it needs root (apt-get install slurm-wlm munge)"
  command -v apt-get >/dev/null || unavailable "Slurm is not installed and this machine has no apt-get (Debian/Ubuntu only)"
  say "installing slurm-wlm and munge with apt-get (a minute or two, once)"
  local added_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then  # packages must not start services themselves
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && added_policy=1
  fi
  local apt=(apt-get -y -q -o DPkg::Lock::Timeout=300 -o Dpkg::Options::=--force-confold install --no-install-recommends slurm-wlm munge)
  local ok=0
  if apt-cache policy slurm-wlm 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" >/tmp/hpdl-local-slurm-apt.log 2>&1 && ok=1
  fi
  if [ "$ok" = 0 ]; then  # package lists missing or stale: refresh once, then try again
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive "${apt[@]}"; } >>/tmp/hpdl-local-slurm-apt.log 2>&1 && ok=1
  fi
  [ "$added_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
  [ "$ok" = 1 ] && installed || unavailable "apt-get could not install slurm-wlm and munge (log: /tmp/hpdl-local-slurm-apt.log: $(tail -n1 /tmp/hpdl-local-slurm-apt.log))"
}

first_job_id() {
  # Job ids must never repeat on this machine: MPICH names its shared-memory segments after
  # the job step (/dev/shm/mpich_shm_*), and a segment left by a killed step with the same id
  # breaks MPI_Init of the new one ("Message truncated"). slurmctld keeps its counter in its
  # state; when that state is missing (first start, or wiped), start from a time-based id.
  local keep=/var/lib/hpdl-local-slurm/first-job-id
  mkdir -p "$(dirname "$keep")"
  if [ -z "$(ls -A /var/spool/slurmctld 2>/dev/null)" ] || [ ! -s "$keep" ]; then
    rm -rf /var/spool/slurmd/*  # slurmd's memory of old job ids goes with slurmctld's
    echo $(( ($(date +%s) / 10) % 50000000 + 1000 )) > "$keep"
  fi
  cat "$keep"
}

render_config() {
  local first; first=$(first_job_id)
  cat <<CONF
$MARK
# A private single-node Slurm for tests; \`local-slurm.sh stop\` ends it.
ClusterName=hpdl
SlurmctldHost=$NODE(127.0.0.1)
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
TaskPluginParam=None
GresTypes=gpu
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=pmi2
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=5
MinJobAge=30
FirstJobId=$first
InactiveLimit=0
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB Gres=gpu:$GPUS State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
}

render_gres() {  # stand-in GPUs: character devices that are /dev/null (made by fake_gpus)
  printf '%s\n%s\n' "$MARK" "NodeName=$NODE Name=gpu File=$RUN/fake-gpu[0-$((GPUS - 1))]"
}

fake_gpus() {  # slurmd counts a node's GPUs by their device files; these are null devices
  local i
  for i in $(seq 0 $((GPUS - 1))); do
    [ -c "$RUN/fake-gpu$i" ] || mknod -m 666 "$RUN/fake-gpu$i" c 1 3 || fail "could not make $RUN/fake-gpu$i"
  done
}

configured() {  # both files are ours and as this script would write them now
  [ -f "$CONF" ] && [ "$(cat "$CONF")" = "$(render_config)" ] && [ -f "$GRES_CONF" ] \
    && [ "$(cat "$GRES_CONF")" = "$(render_gres)" ]
}

write_config() {
  local f
  for f in "$CONF" "$GRES_CONF"; do
    if [ -f "$f" ] && ! head -n1 "$f" | grep -qF "$MARK"; then
      unavailable "$f exists and was not written by this script (a real Slurm site?); not touching it"
    fi
  done
  mkdir -p "$CONF_DIR" "$RUN" "$LOGS" /var/spool/slurmctld /var/spool/slurmd
  fake_gpus
  local new; new=$(render_config)
  if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$new" ]; then
    printf '%s\n' "$new" > "$CONF"
    CONF_CHANGED=1
  fi
  new=$(render_gres)
  if [ ! -f "$GRES_CONF" ] || [ "$(cat "$GRES_CONF")" != "$new" ]; then
    printf '%s\n' "$new" > "$GRES_CONF"
    CONF_CHANGED=1
  fi
}

start_munge() {
  local key=/etc/munge/munge.key
  if [ ! -s "$key" ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of="$key" bs=1024 count=1 status=none || fail "could not write $key"
  fi
  chown munge:munge "$key" /etc/munge && chmod 400 "$key" && chmod 700 /etc/munge
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 755 /run/munge
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi
  detached env -i PATH="$PATH" runuser -u munge -- munged || fail "munged did not start (see /var/log/munge/munged.log)"
  touch "$RUN/munged-ours"
  local i; for i in $(seq 50); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0; sleep 0.1
  done
  fail "munged started but does not answer (see /var/log/munge/munged.log)"
}

start() {
  if running && configured; then
    say "running (node $NODE $(node_state))"; return 0
  fi  # not running, or running an older configuration of this script: (re)start with this one
  [ "$(id -u)" = 0 ] || unavailable "starting a private Slurm needs root"
  local t0; t0=$(date +%s.%N)
  install
  CONF_CHANGED=0
  write_config
  start_munge
  if [ "$CONF_CHANGED" = 1 ] || ! pid_alive /run/slurmctld.pid || ! pid_alive /run/slurmd.pid; then
    stop_daemons
  fi
  # Daemons get a clean environment: none of the caller's variables leak into them.
  pid_alive /run/slurmctld.pid || detached env -i PATH="$PATH" slurmctld \
    || fail "slurmctld did not start; see $LOGS/slurmctld.log: $(tail -n3 $LOGS/slurmctld.log 2>/dev/null)"
  pid_alive /run/slurmd.pid || detached env -i PATH="$PATH" slurmd \
    || fail "slurmd did not start; see $LOGS/slurmd.log: $(tail -n3 $LOGS/slurmd.log 2>/dev/null)"
  local state="" i
  for i in $(seq 300); do
    state=$(node_state)
    case "$state" in
      idle*|mix*|alloc*) break ;;
      drain*|down*|fail*|inval*) scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 ;;
    esac
    sleep 0.2
  done
  case "$state" in idle*|mix*|alloc*) ;; *)
    fail "node $NODE is '${state:-not reporting}' after 60 s; see $LOGS/slurmctld.log and $LOGS/slurmd.log:
$(tail -n5 $LOGS/slurmd.log 2>/dev/null)" ;;
  esac
  # The node may be listed idle from saved state before slurmd has registered: run a step.
  local out="" ran=0
  for i in $(seq 30); do
    out=$(env -i PATH="$PATH" timeout 20 srun -n1 -t 1 -J hpdl-local-slurm-check true 2>&1) && { ran=1; break; }
    sleep 1
  done
  [ "$ran" = 1 ] || fail "a test step does not run: $out (see $LOGS/slurmd.log)"
  say "started in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s (node $NODE $state, $CPUS CPUs, partition debug)"
}

wait_gone() {  # pidfile seconds
  local pid; pid=$(cat "$1" 2>/dev/null) || return 0
  local i; for i in $(seq $(( $2 * 10 ))); do pid_alive "$1" || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null; sleep 0.2
}

stop_daemons() {
  local f
  for f in /run/slurmd.pid /run/slurmctld.pid; do
    pid_alive "$f" && kill -TERM "$(cat "$f")" 2>/dev/null
    wait_gone "$f" 10
    rm -f "$f"
  done
}

stop() {
  if ! [ -f "$CONF" ] || ! head -n1 "$CONF" | grep -qF "$MARK"; then
    say "no private Slurm configured here; nothing to stop"; return 0
  fi
  if pid_alive /run/slurmctld.pid; then
    local jobs; jobs=$(timeout 10 squeue -h -o %i 2>/dev/null)
    if [ -n "$jobs" ]; then
      say "cancelling jobs: $(echo $jobs)"
      timeout 20 scancel $jobs 2>/dev/null
      local i; for i in $(seq 100); do
        [ -z "$(timeout 10 squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2
      done
    fi
  fi
  stop_daemons
  # Job steps the daemons leave behind (none after the cancel above, unless a task ignores TERM).
  local left; left=$(pgrep -x slurmstepd || true)
  [ -n "$left" ] && kill -KILL $left 2>/dev/null
  if [ -f "$RUN/munged-ours" ] && pid_alive /run/munge/munged.pid; then
    kill -TERM "$(cat /run/munge/munged.pid)" 2>/dev/null; wait_gone /run/munge/munged.pid 5
    rm -f "$RUN/munged-ours"
  fi
  say "stopped"
}

status() {
  installed || { echo "local-slurm: not installed"; return 3; }
  if running; then
    echo "local-slurm: running (node $NODE $(node_state); slurmctld pid $(cat /run/slurmctld.pid), slurmd pid $(cat /run/slurmd.pid))"
    return 0
  fi
  echo "local-slurm: not running"; return 1
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; echo "usage: $0 start|stop|status" ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
