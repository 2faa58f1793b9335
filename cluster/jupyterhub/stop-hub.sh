#!/bin/sh
# Stop the workshop hub cleanly (installed as PREFIX/bin/hpdl-hub-stop): SIGTERM to the hub named in
# its pid file; the hub then stops every learner's server (cancelling their Slurm jobs), its proxy and
# its idle culler, and removes the pid file. Waits for that, up to WAIT seconds (default 180).
#
#   hpdl-hub-stop [WAIT]        (HPDL_HUB_STATE: the hub's state folder, default /var/lib/hpdl-hub)
#
# Exit codes: 0 stopped (or none was running); 1 it did not stop in time (what to do is printed).
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac  # the comment above
state="${HPDL_HUB_STATE:-/var/lib/hpdl-hub}"
wait="${1:-180}"
case "$wait" in ''|*[!0-9]*) echo "hpdl-hub-stop: WAIT is a number of seconds, not '$wait' (see --help)" >&2; exit 2 ;; esac
[ $# -le 1 ] || { echo "hpdl-hub-stop: one argument at most, WAIT (see --help)" >&2; exit 2; }
pidfile="$state/jupyterhub.pid"
if [ ! -f "$pidfile" ]; then
  echo "hpdl-hub-stop: no hub running ($pidfile is absent)"
  exit 0
fi
pid="$(cat "$pidfile")"
case "$pid" in ''|*[!0-9]*) echo "hpdl-hub-stop: $pidfile holds no pid: remove it" >&2; exit 1 ;; esac
if ! tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q jupyterhub; then
  echo "hpdl-hub-stop: no hub running (stale $pidfile: process $pid is gone or is not JupyterHub); removed it"
  rm -f "$pidfile"
  exit 0
fi
# running: it exists and is not a zombie (ended, its parent not yet told)
running() { [ -r "/proc/$pid/stat" ] && [ "$(sed 's/.*) //' "/proc/$pid/stat" | cut -c1)" != Z ]; }
kill -TERM "$pid"
waited=0
while running && [ "$waited" -lt "$wait" ]; do
  sleep 1
  waited=$((waited + 1))
done
if running; then
  echo "hpdl-hub-stop: the hub (pid $pid) is still stopping after $wait s, probably waiting for learners'" \
       "jobs to end (squeue -n hpdl-hub). Wait longer (hpdl-hub-stop 600), or end it: kill -KILL $pid," \
       "then scancel -n hpdl-hub and kill the proxy (pid in $state/jupyterhub-proxy.pid)" >&2
  exit 1
fi
echo "hpdl-hub-stop: the hub (pid $pid) stopped in $waited s; its learners' servers and jobs with it"
