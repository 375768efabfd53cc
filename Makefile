# Two commands a newcomer needs: `make demo` and `make test`. Both run `make setup` first,
# which installs what is missing (Debian packages, .venv) and does nothing on a ready machine.
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
TB    := $(VENV)/bin/testbed
PYTEST_ARGS ?=
BENCH_ARGS  ?= --quick

.PHONY: setup demo test test-unit test-network lint lab cleanup doctor warm bench docs-images

setup:
	@VENV=$(VENV) bash .ci/setup.sh

demo: setup
	@$(TB) demo

test: setup
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/pytest $(PYTEST_ARGS)

# The unit tests alone (no network; tests/conftest.py says which are which), on every core;
# then the few that need an otherwise idle CPU (quiet_cpu), one at a time.
UNIT := not mininet and not root_required
test-unit: setup
	@$(VENV)/bin/pytest -m "$(UNIT) and not quiet_cpu" -n auto $(PYTEST_ARGS)
	@$(VENV)/bin/pytest -m "$(UNIT) and quiet_cpu" $(PYTEST_ARGS)

# The network tests alone (root, Mininet), one at a time: they share the emulation lock.
test-network: setup
	@$(VENV)/bin/pytest -m "mininet or root_required" $(PYTEST_ARGS)

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
