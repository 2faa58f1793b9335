#!/usr/bin/env bash
# The images' runscript: JupyterLab in the learner's own workspace. The image's kit (/opt/hpdl,
# HPDL_DIR) is read-only, so `hpdl exercises` copies the lessons, exercises and benchmarks to
# $HPDL_WORKSPACE (default ~/hpdl-workspace, 0700) — new files added, files the learner edited
# kept — and JupyterLab opens there; the kit's cluster/ is linked beside them for reference.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;; esac  # the comment above
set -euo pipefail
umask 077
export HPDL_DIR="${HPDL_DIR:-/opt/hpdl}" PYTHONDONTWRITEBYTECODE=1
bin="$HPDL_DIR/.venv/bin"
HPDL_WORKSPACE="$("$bin/hpdl" exercises --where)"
export HPDL_WORKSPACE
"$bin/hpdl" exercises
[ -e "$HPDL_WORKSPACE/cluster" ] || ln -s "$HPDL_DIR/cluster" "$HPDL_WORKSPACE/cluster"
cd "$HPDL_WORKSPACE"
exec "$bin/jupyter" lab --no-browser --ServerApp.ip=0.0.0.0 --ServerApp.root_dir="$HPDL_WORKSPACE" \
  --ServerApp.default_url=/lab/tree/notebooks/00_welcome.ipynb "$@"
