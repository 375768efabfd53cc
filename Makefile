# Two commands a newcomer needs: `make demo` and `make test`. Both run `make setup` first,
# which installs what is missing (Debian packages, .venv) and does nothing on a ready machine.
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
TB    := $(VENV)/bin/testbed
PYTEST_ARGS ?=
BENCH_ARGS  ?= --quick

.PHONY: setup demo test test-unit test-network _unit _network lint lab cleanup doctor warm bench docs-images

setup:
	@VENV=$(VENV) bash .ci/setup.sh

demo: setup
	@$(TB) demo

# Lint, then the unit tests on every core, then the network tests one at a time.
test: setup
	@$(VENV)/bin/ruff check .
	@$(MAKE) --no-print-directory _unit _network

# The unit tests alone (no network; tests/conftest.py says which are which), on every core;
# then the few that need an otherwise idle CPU (quiet_cpu), one at a time. Work stealing: a
# few tests compile big kernels on a cold cache (30-40 s each), and a worker whose own queue
# ran dry would idle while the other's waits behind them (three cold runs each, alternated:
# 155-174 s stealing, 176-184 s without).
# MARK narrows every run to tests with these markers (e.g. MARK=datapath: a folder); a run
# that then selects nothing (pytest's exit status 5) is not a failure.
UNIT := not mininet and not root_required
MARK ?=
SEL = $(if $(MARK),($(MARK)) and ,)
PYTEST_RUN = $(VENV)/bin/pytest $(PYTEST_ARGS) -m
test-unit: setup _unit
_unit:
	@$(PYTEST_RUN) "$(SEL)$(UNIT) and not quiet_cpu" -n auto --dist worksteal || [ $$? -eq 5 ]
	@$(PYTEST_RUN) "$(SEL)$(UNIT) and quiet_cpu" || [ $$? -eq 5 ]

# The network tests alone (root, Mininet), one at a time: they share the emulation lock.
test-network: setup _network
_network:
	@$(PYTEST_RUN) "$(SEL)(mininet or root_required)" || [ $$? -eq 5 ]

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
