#!/usr/bin/env bash
# The hub's environment, beside the kit's (`make hub`):
#
#   .venv-hub   JupyterHub, batchspawner and jupyterhub-idle-culler (requirements.txt here),
#               layered on the kit's venv: it sees the kit's packages and pip adds only what the
#               kit lacks, so the kit's venv is not changed; plus configurable-http-proxy from npm.
#
# The hub runs from .venv-hub. Each learner's JupyterLab runs with the kit's own Python (the same
# JupyterLab, kernel and ranks as `make lab`), with .venv-hub's packages on its PYTHONPATH only
# for talking to the hub (jupyterhub-singleuser, batchspawner-singleuser); see singleuser.sbatch.
#
#   cluster/jupyterhub/install.sh                               # kit venv .venv, hub env .venv-hub
#   HPDL_KIT_VENV=/shared/hpdl/.venv HPDL_HUB_ENV=/shared/hpdl/.venv-hub cluster/jupyterhub/install.sh
#
# Exit codes: 0 installed (or already); 1 failed; 3 cannot be installed here (no kit venv, no npm,
# or learners could not run the kit's Python), with the reason.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
kit="$(cd "$here/../.." && pwd)"
KIT_VENV="${HPDL_KIT_VENV:-$kit/.venv}"
HUB_ENV="${HPDL_HUB_ENV:-$kit/.venv-hub}"
CHP_VERSION=5.3.0
umask 022  # learners' jobs read both environments

cannot() { echo "hub install: cannot: $*" >&2; exit 3; }

PY="$KIT_VENV/bin/python"
"$PY" -c "import hpdl, jupyterlab" 2>/dev/null \
  || cannot "no kit venv with hpdl and JupyterLab at $KIT_VENV: run \`make setup\` (or set HPDL_KIT_VENV)"
if [ "$(id -u)" = 0 ] && ! runuser -u nobody -- "$PY" -c "import hpdl" >/dev/null 2>&1; then
  cannot "learners could not run the kit's Python $PY (it is $(readlink -f "$PY"), in a folder other users \
cannot enter). Build the kit's venv from a Python every learner can run, e.g. \
\`make setup VENV=.venv-shared PYTHON=/usr/bin/python3\`, then \`HPDL_KIT_VENV=$kit/.venv-shared make hub\`"
fi
command -v npm >/dev/null && command -v node >/dev/null \
  || cannot "configurable-http-proxy needs Node.js and npm: apt-get install nodejs npm"

stamp="$HUB_ENV/.hpdl-hub-installed"
want="$(cat "$here/requirements.txt"; echo "kit=$KIT_VENV chp=$CHP_VERSION")"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$HUB_ENV/node_modules/.bin/configurable-http-proxy" ]; then
  echo "hub install: $HUB_ENV is up to date"
  exit 0
fi

start=$(date +%s)
# A venv of the kit's own interpreter, without pip of its own (the kit's pip is visible through the layer).
"$PY" -m venv --clear --without-pip "$HUB_ENV"
kit_site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
hub_site="$("$HUB_ENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# addsitedir (not a plain path line) so the kit's own .pth files (its editable hpdl) work here too
echo "import site; site.addsitedir('$kit_site')" > "$hub_site/hpdl-kit.pth"
"$HUB_ENV/bin/python" -m pip install -q --disable-pip-version-check -r "$here/requirements.txt"
npm install --prefix "$HUB_ENV" --no-audit --no-fund --loglevel=error "configurable-http-proxy@$CHP_VERSION" >/dev/null
"$HUB_ENV/bin/python" -c "import jupyterhub, batchspawner, jupyterhub_idle_culler, hpdl" \
  || { echo "hub install: failed: $HUB_ENV cannot import the hub's packages and the kit" >&2; exit 1; }
"$HUB_ENV/node_modules/.bin/configurable-http-proxy" --version >/dev/null \
  || { echo "hub install: failed: configurable-http-proxy does not run" >&2; exit 1; }
printf '%s\n' "$want" > "$stamp"
echo "hub install: $HUB_ENV ready in $(( $(date +%s) - start )) s (JupyterHub $("$HUB_ENV/bin/jupyterhub" --version)," \
  "configurable-http-proxy $CHP_VERSION; the kit from $KIT_VENV)"
