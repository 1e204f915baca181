# Benchmarks (not part of the test suite): run as root from the repository root.
# `make bench` runs everything (about 10-15 minutes on 2 vCPU), `make bench-quick` fewer
# repetitions and sizes (under 3 minutes). See bench/README.md.
PYTHON ?= .venv/bin/python

.PHONY: bench bench-quick bench-setup

bench-setup:
	bash scripts/setup.sh
	$(PYTHON) -m pip install -q -e '.[bench]'

bench: bench-setup
	$(PYTHON) -m bench

bench-quick: bench-setup
	$(PYTHON) -m bench --quick
