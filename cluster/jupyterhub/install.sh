#!/usr/bin/env bash
# The workshop hub, installed root-owned outside the kit (`sudo make hub`, or this script as root).
#
# The hub runs as root (it submits each learner's job as that learner), so nothing it runs may be a
# file the kit's owner (or anyone but root) can change. This script copies what the hub needs from
# the kit into PREFIX (HPDL_HUB_PREFIX, default /opt/hpdl-hub), root-owned, 0755:
#
#   PREFIX/venv        the hub's venv: JupyterHub, batchspawner, jupyterhub-idle-culler (requirements.txt),
#                      made from a root-owned Python (HPDL_HUB_PYTHON; default: the kit venv's base Python)
#   PREFIX/kit         a copy of the kit's hpdl package and cluster/sites (the config reads settings and
#                      site profiles through it), on the hub venv's path
#   PREFIX/proxy       configurable-http-proxy from npm
#   PREFIX/singleuser  what each learner's job adds to the kit's Python to talk to the hub
#                      (jupyterhub-singleuser, batchspawner-singleuser), pinned to the kit's versions
#   PREFIX/etc         jupyterhub_config.py, singleuser.sbatch, install.json (where the kit is),
#                      hub.env (the settings; written once, then yours) and hpdl-hub.service
#   PREFIX/bin         hpdl-hub (start, as root) and hpdl-hub-stop (stop; every learner's job is cancelled)
#
# The kit's own code is only ever run as `nobody` here (to ask its versions). Re-run after updating
# the kit: the copies are refreshed (the venvs only when their inputs changed).
#
#   sudo cluster/jupyterhub/install.sh
#   sudo HPDL_KIT_VENV=/shared/hpdl/.venv HPDL_HUB_PREFIX=/opt/hpdl-hub cluster/jupyterhub/install.sh
#
# Exit codes: 0 installed (or up to date); 1 failed; 3 cannot be installed here (not root, no kit venv
# learners can run, no npm, an unsafe Python), with the reason.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;; esac  # the comment above
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
kit="$(cd "$here/../.." && pwd)"
KIT_VENV="${HPDL_KIT_VENV:-$kit/.venv}"
KIT_VENV="$(cd "$KIT_VENV" 2>/dev/null && pwd || echo "$KIT_VENV")"  # absolute: the script works from /
PREFIX="${HPDL_HUB_PREFIX:-/opt/hpdl-hub}"
CHP_VERSION=5.3.0
umask 022  # learners' jobs read PREFIX/singleuser; everything here is root's to change

cannot() { echo "hub install: cannot: $*" >&2; exit 3; }
failed() { echo "hub install: failed: $*" >&2; exit 1; }
as_nobody() { runuser -u nobody -- env -i PATH=/usr/bin:/bin HOME=/ "$@"; }

# Why someone other than root could change $1 (it or a folder above it); nothing when only root can.
unsafe() {
  local p; p="$(readlink -f "$1")"
  while :; do
    read -r owner mode < <(stat -c '%u %a' "$p")
    [ "$owner" = 0 ] || { echo "$p belongs to uid $owner"; return; }
    if (( 8#$mode & 8#022 )) && ! { [ -d "$p" ] && (( 8#$mode & 8#1000 )) && [ "$p" != "$(readlink -f "$1")" ]; }; then
      echo "$p is writable by others (mode $mode)"; return
    fi
    [ "$p" = / ] && return
    p="$(dirname "$p")"
  done
}

[ "$(id -u)" = 0 ] || cannot "run as root: the hub's install is root-owned (sudo $0)"
cd /  # `python -m`/`-c` put the working folder first on sys.path: never the kit's, never the caller's
unset PYTHONPATH PYTHONHOME PYTHONSTARTUP PYTHONUSERBASE  # nor the caller's Python settings
command -v runuser >/dev/null || cannot "no runuser (util-linux)"
KIT_PY="$KIT_VENV/bin/python"
kit_info="$(as_nobody "$KIT_PY" -c 'import hpdl, jupyterlab, sys; print(sys.version_info[0], sys.version_info[1], sys._base_executable)' 2>/dev/null)" \
  || cannot "learners could not run the kit's Python $KIT_PY with hpdl and JupyterLab (no kit venv there, or \
it is $(readlink -f "$KIT_PY" 2>/dev/null || echo missing), in a folder other users cannot enter). Build the kit's venv from a \
Python every learner can run, e.g. \`make setup VENV=.venv-shared PYTHON=/usr/bin/python3\`, then \
\`sudo HPDL_KIT_VENV=$kit/.venv-shared make hub\`"
read -r kit_major kit_minor kit_base <<<"$kit_info"
HUB_PY="$(readlink -f "${HPDL_HUB_PYTHON:-$kit_base}")"
why="$(unsafe "$HUB_PY")"
[ -z "$why" ] || cannot "the hub's Python $HUB_PY is not root's alone ($why): set HPDL_HUB_PYTHON to a root-owned \
Python $kit_major.$kit_minor (e.g. /usr/bin/python3)"
"$HUB_PY" -c "import sys; sys.exit(sys.version_info[:2] != ($kit_major, $kit_minor))" \
  || cannot "$HUB_PY is not Python $kit_major.$kit_minor like the kit's: learners' jobs load the hub's packages \
into the kit's Python. Set HPDL_HUB_PYTHON to a root-owned Python $kit_major.$kit_minor"
command -v npm >/dev/null && command -v node >/dev/null \
  || cannot "configurable-http-proxy needs Node.js and npm: apt-get install nodejs npm"
why="$(unsafe "$(dirname "$PREFIX")")"
[ -z "$why" ] || cannot "$PREFIX would sit in a folder not root's alone ($why): choose another HPDL_HUB_PREFIX"

start=$(date +%s)
mkdir -p "$PREFIX"/{etc,bin}
chown root:root "$PREFIX" "$PREFIX"/{etc,bin}
chmod 0755 "$PREFIX" "$PREFIX"/{etc,bin}
work="$(mktemp -d "$PREFIX/.install.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# -- the environments: rebuilt only when what they are made from changed ------------------------------
kit_freeze="$(as_nobody "$KIT_PY" -c 'import importlib.metadata as m
print("\n".join(sorted({f"{d.name}=={d.version}" for d in m.distributions() if d.name})))')" \
  || cannot "the kit's Python $KIT_PY cannot list its packages"
want="$(cat "$here/requirements.txt"; echo "python=$HUB_PY chp=$CHP_VERSION"; echo "$kit_freeze")"
stamp="$PREFIX/.installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$PREFIX/proxy/node_modules/.bin/configurable-http-proxy" ]; then
  echo "hub install: the environments in $PREFIX are up to date"
else
  rm -f "$stamp"
  "$HUB_PY" -m venv --clear "$PREFIX/venv"
  "$PREFIX/venv/bin/python" -m pip install -q --disable-pip-version-check -r "$here/requirements.txt" \
    || failed "pip could not install $here/requirements.txt into $PREFIX/venv"
  # the learners' side: jupyterhub and batchspawner for the kit's Python, every package it shares with
  # the kit pinned to the kit's version (so they shadow nothing with another version)
  printf '%s\n' "$kit_freeze" > "$work/kit-constraints.txt"
  hub_pins="$(grep -E '^(jupyterhub|batchspawner)==' "$here/requirements.txt")"
  # shellcheck disable=SC2086
  "$PREFIX/venv/bin/python" -m pip install -q --disable-pip-version-check --target "$work/singleuser" \
      -c "$work/kit-constraints.txt" $hub_pins \
    || failed "pip could not install the learners' side ($hub_pins) at the kit's versions into $PREFIX/singleuser"
  rm -rf "$PREFIX/singleuser" && mv "$work/singleuser" "$PREFIX/singleuser"
  npm install --prefix "$work/proxy" --no-audit --no-fund --loglevel=error "configurable-http-proxy@$CHP_VERSION" >/dev/null \
    || failed "npm could not install configurable-http-proxy@$CHP_VERSION"
  rm -rf "$PREFIX/proxy" && mv "$work/proxy" "$PREFIX/proxy"
  "$PREFIX/venv/bin/python" -c "import jupyterhub, batchspawner, jupyterhub_idle_culler" \
    || failed "$PREFIX/venv cannot import the hub's packages"
  as_nobody env PYTHONPATH="$PREFIX/singleuser" "$KIT_PY" -c "import jupyterhub.singleuser, batchspawner.singleuser" \
    || failed "the kit's Python cannot import jupyterhub.singleuser with $PREFIX/singleuser (learners' jobs would fail)"
  "$PREFIX/proxy/node_modules/.bin/configurable-http-proxy" --version >/dev/null \
    || failed "configurable-http-proxy does not run"
fi

# -- the kit's files the hub reads, copied (links followed, no caches); the hub's own files -----------
mkdir -p "$work/kit"
tar -C "$kit" --dereference --exclude=__pycache__ --exclude='*.pyc' -cf - hpdl cluster/sites \
  | tar -C "$work/kit" --no-same-owner --no-same-permissions -xf -
rm -rf "$PREFIX/kit" && mv "$work/kit" "$PREFIX/kit"
site="$("$PREFIX/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$PREFIX/kit" > "$site/hpdl-hub-kit.pth"
install -m 0644 "$here/jupyterhub_config.py" "$here/singleuser.sbatch" "$PREFIX/etc/"
printf '{"kit": "%s", "kit_venv": "%s"}\n' "$kit" "$KIT_VENV" > "$PREFIX/etc/install.json"
cat > "$PREFIX/bin/hpdl-hub" <<EOF
#!/bin/sh
# The workshop hub (as root; settings from the environment, e.g. $PREFIX/etc/hub.env). Written by install.sh.
# No inherited Python path: what the root hub imports is what install.sh put here.
unset PYTHONPATH PYTHONHOME PYTHONSTARTUP PYTHONUSERBASE
cd / && exec "$PREFIX/venv/bin/jupyterhub" -f "$PREFIX/etc/jupyterhub_config.py" "\$@"
EOF
install -m 0755 "$here/stop-hub.sh" "$PREFIX/bin/hpdl-hub-stop"
chmod 0755 "$PREFIX/bin/hpdl-hub"
if [ ! -e "$PREFIX/etc/hub.env" ]; then  # the site's settings: written once, never overwritten
  install -m 0600 "$here/hub.env" "$PREFIX/etc/hub.env"
fi
sed "s|@PREFIX@|$PREFIX|g" "$here/hpdl-hub.service" > "$PREFIX/etc/hpdl-hub.service"
chown -R root:root "$PREFIX"
# the hub's copy of the kit is the whole package, answer keys and the kit's own answers in it (hpdl/checker/cases,
# hpdl/predict.py...): for the root hub alone, not for the learners whose notebooks run on this host
chmod 0700 "$PREFIX/kit"
chmod -R go-w "$PREFIX"

# -- it works, and runs nothing but root's -----------------------------------------------------------
"$PREFIX/venv/bin/python" -c "
import sys, hpdl.settings, hpdl.sites
sys.exit(not hpdl.settings.__file__.startswith('$PREFIX/kit/'))" \
  || failed "$PREFIX/venv does not import its copy of hpdl from $PREFIX/kit"
printf '%s\n' "$want" > "$stamp"
echo "hub install: $PREFIX ready in $(( $(date +%s) - start )) s (JupyterHub $("$PREFIX/venv/bin/jupyterhub" --version)," \
  "configurable-http-proxy $CHP_VERSION; the kit at $kit, its Python $KIT_PY). Start: $PREFIX/bin/hpdl-hub" \
  "(settings in $PREFIX/etc/hub.env), or the unit $PREFIX/etc/hpdl-hub.service"
