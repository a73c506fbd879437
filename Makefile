# The README's commands. Each creates/updates .venv from pyproject.toml first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

## make demo: the full ladder (unit -> smoke -> canary -> full) on the bundled digits spec
demo: setup
	$(VENV)/bin/traingate run examples/digits.yaml

## make test: the whole suite, slow end-to-end tests included
test: setup
	$(PY) -m pytest -ra

## make bench: benchmarks; numbers go into README.md
bench: setup
	$(PY) -m bench

clean:
	rm -rf .traingate
