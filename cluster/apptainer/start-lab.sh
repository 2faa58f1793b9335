#!/usr/bin/env bash
# The images' runscript: JupyterLab on the lessons, run from a folder the learner can write.
# The image (/opt/hpdl) is read-only, so the lessons and exercises are copied to $HPDL_WORK
# (default ~/hpdl-work) — new files added, files the learner edited kept (`hpdl exercises`) —
# and the kit's benchmarks/ and cluster/ are linked beside them.
set -euo pipefail
kit=/opt/hpdl
work="${HPDL_WORK:-$HOME/hpdl-work}"
mkdir -p "$work"
"$kit/.venv/bin/hpdl" exercises --source "$kit/notebooks" --dest "$work/notebooks"
"$kit/.venv/bin/hpdl" exercises --source "$kit/exercises" --dest "$work/exercises"
for d in benchmarks cluster; do
  [ -e "$work/$d" ] || ln -s "$kit/$d" "$work/$d"
done
cd "$work"
exec "$kit/.venv/bin/jupyter" lab --no-browser --ServerApp.ip=0.0.0.0 --ServerApp.root_dir="$work" \
  --ServerApp.default_url=/lab/tree/notebooks/00_welcome.ipynb "$@"
