# Two commands a newcomer needs: `make demo` and `make test`. Both run `make setup` first,
# which installs what is missing (Debian packages, .venv) and does nothing on a ready machine.
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
TB    := $(VENV)/bin/testbed
PYTEST_ARGS ?=
BENCH_ARGS  ?= --quick

.PHONY: setup demo test lint lab cleanup doctor warm bench docs-images

setup:
	@VENV=$(VENV) bash .ci/setup.sh

demo: setup
	@$(TB) demo

test: setup
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/pytest $(PYTEST_ARGS)

lint: setup
	@$(VENV)/bin/ruff check .

lab: setup
	@$(TB) lab

doctor: setup
	@$(TB) doctor

cleanup: setup
	@$(TB) cleanup

warm: setup
	@$(TB) warm

# every benchmark in its quick form; `make bench BENCH_ARGS=` for the full forms (hours)
bench: setup
	@$(TB) bench all $(BENCH_ARGS)

# The README's pictures under docs/images/: the architecture diagram, the demo's table and plot,
# one figure per notebook. Runs the demo and every notebook: root, several minutes.
docs-images: setup
	@$(PY) docs/images/make_images.py
