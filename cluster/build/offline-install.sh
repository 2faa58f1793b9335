#!/usr/bin/env bash
# Install the kit from a wheelhouse (`hpdl wheelhouse build`), with no network at all: the kit's tree
# at PREFIX, its venv at PREFIX/.venv with every wheel from the wheelhouse alone, its Jupyter kernel.
# Needs bash and python3 (the kit is not installed yet); a copy of this script sits in each wheelhouse.
#
#   /shared/hpdl-wheels/offline-install.sh --prefix /opt/hpdl                     # as root, for everyone
#   offline-install.sh --from /shared/hpdl-wheels --prefix /proj/course/hpdl --python /usr/bin/python3.11
#   offline-install.sh ... --hub-env /opt/hpdl-hub      # also the workshop hub's environment and proxy
#
# PREFIX: a new or empty folder, a folder this script installed before (its kit files are replaced),
# or a clone of the kit (used as it is). Learners then use PREFIX/.venv (site profiles: `setup`).
# It may be made read-only afterwards: bytecode is compiled here, nothing is written there later.
# Exit codes: 0 installed; 1 failed; 2 refused (bad arguments, a wheelhouse that is incomplete, damaged
# or for another Python, a Python learners could not run), with what to do.
set -euo pipefail
umask 022  # learners read everything installed here
from="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
prefix="" python="python3" hub_env=""
usage() { sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
refuse() { echo "offline-install: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --from) from="${2:?--from needs a folder}"; shift 2 ;;
    --prefix) prefix="${2:?--prefix needs a folder}"; shift 2 ;;
    --python) python="${2:?--python needs an interpreter}"; shift 2 ;;
    --hub-env) hub_env="${2:?--hub-env needs a folder}"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) refuse "unknown argument $1 (see --help)" ;;
  esac
done
[ -n "$prefix" ] || refuse "--prefix is required: the folder the kit goes to (e.g. /opt/hpdl)"
[ -f "$from/MANIFEST.json" ] || refuse "$from has no MANIFEST.json: give --from the folder \`hpdl wheelhouse build\` wrote"
command -v "$python" >/dev/null || refuse "no $python here: give --python the Python 3 the nodes run"
py="$(command -v "$python")"
# pip is told nothing but this command line: no index, no find-links or constraints from the environment
for v in $(env | sed -n 's/^\(PIP_[A-Z_]*\)=.*/\1/p'); do unset "$v"; done
export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1

# Every file the manifest names is there, intact, and the wheels are for this Python: else refuse now.
"$py" - "$from" <<'PY' || exit 2
import hashlib, json, platform, sys
from pathlib import Path
src = Path(sys.argv[1])
meta = json.loads((src / "MANIFEST.json").read_text())
where = f"offline-install: the wheelhouse {src}"
have = "%d.%d" % sys.version_info[:2]
if have != meta["python"] or platform.machine() != meta["machine"]:
    sys.exit(f"{where} is for Python {meta['python']} on {meta['machine']}; {sys.executable} is {have} on "
             f"{platform.machine()}: give --python a {meta['python']}, or build the wheelhouse with this Python")
bad = []
for name, f in meta["files"].items():
    p = src / name
    if not p.is_file():
        bad.append(f"{name}: missing")
        continue
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    if h.hexdigest() != f["sha256"]:
        bad.append(f"{name}: damaged (sha256 differs)")
if bad:
    sys.exit(f"{where} is incomplete; copy it again or rebuild it:\n  " + "\n  ".join(bad))
print(f"offline-install: wheelhouse {src}: kit {meta['kit']}, target {meta['target']} (needs: {meta['needs']}), "
      f"MPI {meta['mpi']}, {len(meta['files'])} files checked")
PY
manifest() { "$py" -c "import json, sys; m = json.load(open(sys.argv[1])); v = m[sys.argv[2]]; print('\n'.join(v) if isinstance(v, list) else (v or ''))" "$from/MANIFEST.json" "$1"; }

# As root for everyone: learners must be able to run this Python (not one under /root, say).
if [ "$(id -u)" = 0 ] && command -v runuser >/dev/null && ! runuser -u nobody -- "$py" -c "" 2>/dev/null; then
  refuse "learners could not run $py ($(readlink -f "$py"), in a folder other users cannot enter): \
give --python a Python every user can run, e.g. --python /usr/bin/python3"
fi

mkdir -p "$prefix"
prefix="$(cd "$prefix" && pwd)"
kit_tree="$(manifest kit_tree)"
if [ -f "$prefix/pyproject.toml" ] && [ -d "$prefix/hpdl" ] && [ ! -f "$prefix/.hpdl-offline-install" ]; then
  echo "offline-install: $prefix is a copy of the kit: installing it as it is"
elif [ -f "$prefix/.hpdl-offline-install" ] || [ -z "$(ls -A "$prefix")" ]; then
  tar -xzf "$from/$kit_tree" -C "$prefix" --no-same-owner --no-same-permissions
  echo "$kit_tree" > "$prefix/.hpdl-offline-install"
else
  refuse "$prefix is not empty, not a copy of the kit and not an earlier install: give --prefix a new or empty folder"
fi

start=$(date +%s)
venv="$prefix/.venv"
"$py" -m venv --clear "$venv"
reqs="$(mktemp)"; trap 'rm -f "$reqs"' EXIT
manifest install > "$reqs"
if ! out="$("$venv/bin/python" -m pip install -q --find-links "$from" setuptools -r "$reqs" 2>&1)"; then
  echo "$out" | tail -n 15 >&2
  echo "offline-install: failed: pip could not install the kit's packages from $from alone (above): the" \
       "wheelhouse lacks a wheel that Python $("$py" -c 'import platform; print(platform.python_version())') needs" \
       "(it was resolved for Python $(manifest python_full)). Rebuild it with this Python:" \
       "make wheelhouse PYTHON=$py ARGS=\"...\" (or hpdl wheelhouse build --python $py)" >&2
  exit 1
fi
"$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$prefix" >/dev/null
"$venv/bin/python" -m compileall -q "$prefix/hpdl" >/dev/null || true
"$venv/bin/python" -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (hpdl)" >/dev/null
# JupyterLab's defaults for every learner of this venv: no "get notified about Jupyter news?" prompt, no update check
install -D -m 644 "$prefix/cluster/build/jupyterlab-overrides.json" "$venv/share/jupyter/lab/settings/overrides.json"
"$venv/bin/python" -c "import hpdl, torch, mpi4py.MPI, horovod.torch, jupyterlab, ipyparallel" \
  || { echo "offline-install: failed: the kit's venv cannot import its packages (above)" >&2; exit 1; }
if [ "$(id -u)" = 0 ] && command -v runuser >/dev/null && ! runuser -u nobody -- "$venv/bin/python" -c "import hpdl" 2>/dev/null; then
  echo "offline-install: failed: other users cannot run $venv/bin/python (is $prefix inside a private folder?)" >&2
  exit 1
fi
echo "offline-install: the kit is in $prefix, its venv $venv ($(( $(date +%s) - start )) s; torch" \
     "$("$venv/bin/python" -c 'import torch; print(torch.__version__)'))."

if [ -n "$hub_env" ]; then
  # The hub's environment as cluster/jupyterhub/install.sh makes it: layered on the kit's venv
  [ -n "$(manifest hub_install)" ] || refuse "this wheelhouse was built with --no-hub: it has no hub environment"
  "$venv/bin/python" -m venv --clear --without-pip "$hub_env"
  kit_site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  hub_site="$("$hub_env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "import site; site.addsitedir('$kit_site')" > "$hub_site/hpdl-kit.pth"
  manifest hub_install > "$reqs"
  "$hub_env/bin/python" -m pip install -q --find-links "$from" -r "$reqs"
  proxy="$(manifest proxy)"
  if [ -n "$proxy" ]; then
    tar -xzf "$from/$proxy" -C "$hub_env" --no-same-owner
    echo "offline-install: the hub's environment is $hub_env (proxy: $hub_env/node_modules/.bin/configurable-http-proxy; needs Node.js)"
  else
    echo "offline-install: the hub's environment is $hub_env; its proxy was not packed: npm install configurable-http-proxy there" >&2
  fi
fi
echo "offline-install: check it with: $venv/bin/hpdl doctor"
