# hpdl — the two commands a learner needs:
#   make lab    install on first run, then start JupyterLab at notebooks/00_welcome.ipynb
#   make test   install on first run, then run every test
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hpdl-installed
LAB_PORT ?= 8888
LAB_ARGS ?=
PYTEST_ARGS ?=
# JupyterLab refuses to run as root (containers, CI) unless told
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: lab test test-hub hub lint setup horovod build check-build bench doctor clean-venv cleanup

lab: setup
	@echo "hpdl: starting JupyterLab (stop with Ctrl-C; ranks you started stop with it)"
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.port=$(LAB_PORT) \
	  --ServerApp.root_dir="$(CURDIR)" $(ALLOW_ROOT) $(LAB_ARGS) notebooks/00_welcome.ipynb

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

# The workshop hub (cluster/jupyterhub): its environment, and its end-to-end test (minutes; root,
# the local Slurm, Chromium). HPDL_KIT_VENV: the kit's venv learners run, if not $(VENV).
hub: setup
	HPDL_KIT_VENV="$${HPDL_KIT_VENV:-$(CURDIR)/$(VENV)}" bash cluster/jupyterhub/install.sh

test-hub: setup
	$(PY) -m pytest -m hub tests/test_hub.py $(PYTEST_ARGS)

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml cluster/build/horovod.sh cluster/build/relocate_wheel.py
	@start=$$(date +%s); \
	test -x $(PY) || $(PYTHON) -m venv $(VENV); \
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt && \
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e . && \
	PYTHON=$(PY) bash cluster/build/horovod.sh && \
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (hpdl)" >/dev/null && \
	touch $(STAMP) && \
	echo "hpdl: installed in $$(( $$(date +%s) - start )) s"

horovod: setup

lint: setup
	$(VENV)/bin/ruff check .

build: setup
	$(VENV)/bin/hpdl build

check-build: setup
	$(VENV)/bin/hpdl build --check

doctor: setup
	$(VENV)/bin/hpdl doctor

cleanup:
	-$(VENV)/bin/hpdl cleanup

clean-venv:
	rm -rf $(VENV)
