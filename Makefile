# The README's commands. Each creates/updates .venv from pyproject.toml first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test-deps demo test test-fast bench clean

# uv installs the project's packages (the versions pip would pick) and compiles them to bytecode on both cores:
# ~67 CPU-s where pip spends ~130. Compiled up front, not by the first processes that import them: the suite starts
# many processes at once, which would each compile torch. A directory of local wheels (/opt/wheels: this machine's
# CPU build of torch) is searched beside PyPI, as pip's configuration does here.
UV_VERSION := 0.13.9
WHEELS     ?= /opt/wheels
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	test -x $(VENV)/bin/uv || $(PY) -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)
	$(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY) $(if $(wildcard $(WHEELS)),--find-links $(WHEELS)) -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

## make demo: the full ladder (unit -> smoke -> canary -> full) on the bundled digits spec
demo: setup
	$(VENV)/bin/traingate run examples/digits.yaml

# The native production stack's test (tests/production/test_local_stack.py) runs Debian's PostgreSQL 15.
PG_BIN := /usr/lib/postgresql/15/bin
# The Slurm fixture (tests/slurm/cluster.py) runs Debian's Slurm 22.05 daemons, munge and MariaDB by hand;
# apt's policy-rc.d may start the services on install: they are stopped, the fixture starts its own.
SLURM_PKGS := slurmctld slurmd slurm-client slurmdbd munge mariadb-server
# The stack test's browser check drives Debian's Chromium headless through its chromedriver (Selenium).
BROWSER_PKGS := chromium chromium-driver
test-deps:
	test -x $(PG_BIN)/initdb || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql-15)
	missing=$$(for p in $(SLURM_PKGS); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing || \
	    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing); \
	  for s in slurmctld slurmd slurmdbd munge mariadb; do service $$s stop >/dev/null 2>&1 || true; done; \
	fi
	missing=$$(for p in $(BROWSER_PKGS); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing || \
	    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing); \
	fi

# Three pytest-xdist workers on the 2-core machine: the suite's tests wait on servers, Slurm and
# subprocesses for about a third of their time, which a third worker fills. A test file stays on
# one worker, so a module's shared ladder or server starts once. Files are handed out in the order
# tests/conftest.py sorts them (most long tests first); xdist's default reorder by test count would
# start the one-test end-to-end files last.
XDIST := -n 3 --dist loadfile --no-loadscope-reorder

# The project's own modules compiled to bytecode once (~0.5 CPU-s): the suite starts thousands of processes
# (CLIs, supervisors, torchrun workers) that import them, and where PYTHONDONTWRITEBYTECODE is set (as on these
# machines) none of them writes its bytecode, so each would compile what it imports again (18% of the CPU of the
# supervision tests).
COMPILE := $(PY) -m compileall -q -j 0 traingate flows tasks bench tests >/dev/null

## make test: the whole suite, slow end-to-end tests included. The venv (pip) and the Debian packages (apt)
## install side by side: one waits on PyPI while the other unpacks.
test:
	$(MAKE) --no-print-directory -j2 setup test-deps
	$(COMPILE)
	$(PY) -m pytest $(XDIST) -ra --durations=40

## make test-fast: the inner loop: everything but the slow tests (servers, torchrun, ladders) and the
## Slurm tests (a whole test cluster, root and make test-deps; `pytest -m slurm` runs them alone)
test-fast: setup
	$(COMPILE)
	$(PY) -m pytest $(XDIST) -m "not slow and not slurm" -ra --durations=20

## make bench: benchmarks; their tables go into docs/benchmarks.md
bench: setup
	$(PY) -m bench

clean:
	rm -rf .traingate
