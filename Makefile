# Two commands a newcomer needs: `make demo` and `make test`. Both run `make setup` first,
# which installs what is missing (Debian packages, .venv) and does nothing on a ready machine.
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
TB    := $(VENV)/bin/testbed
PYTEST_ARGS ?=

.PHONY: setup demo test lint lab cleanup doctor bench

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

bench: setup
	@$(TB) bench all
