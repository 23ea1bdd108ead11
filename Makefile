# Conveniences; each target is one command from the README or docs/performance.md.
PYTHON := .venv/bin/python

.PHONY: setup test lint bench bench-quick

setup:
	test -x $(PYTHON) || python3 -m venv .venv
	$(PYTHON) -m pip install -q --disable-pip-version-check -e '.[test,all]'

test:
	scripts/test

# ruff, mypy, actionlint and zizmor without the tests (about 20 s the first time, 5 s after); scripts/test runs
# the same script first. Sets up .venv when its test tools are missing.
lint:
	test -x .venv/bin/zizmor || $(MAKE) setup
	scripts/lint

# Every benchmark, then the tables for docs/performance.md (about 75 minutes on 2 cores).
bench: setup
	$(PYTHON) bench/latency.py
	$(PYTHON) bench/cost.py
	$(PYTHON) bench/forwarding.py
	$(PYTHON) bench/soak.py
	$(PYTHON) bench/hostile.py
	$(PYTHON) bench/tls.py
	$(PYTHON) bench/node_actions.py
	cd bench && ../$(PYTHON) image.py
	$(PYTHON) bench/fleet.py
	$(PYTHON) bench/fleet.py --vms 10000 50000 100000
	$(PYTHON) bench/fleet_outbox.py
	$(PYTHON) bench/fleet_act.py
	$(PYTHON) bench/report.py | tee bench/results/report.md

# A smoke run of the same (about 16 minutes): small samples, figures not for publishing.
bench-quick: setup
	$(PYTHON) bench/latency.py --changes 20
	$(PYTHON) bench/cost.py --quick
	$(PYTHON) bench/forwarding.py --records 10000
	$(PYTHON) bench/soak.py --hours 2 --minutes 3 --kill-every 40
	$(PYTHON) bench/hostile.py --quick
	$(PYTHON) bench/tls.py --quick
	$(PYTHON) bench/node_actions.py --quick
	cd bench && ../$(PYTHON) image.py --settle 10 --samples 5
	$(PYTHON) bench/fleet.py --quick
	$(PYTHON) bench/fleet_outbox.py --vms 20000 --refuse 10 --max-records 10000
	$(PYTHON) bench/fleet_act.py --quick
	$(PYTHON) bench/report.py
