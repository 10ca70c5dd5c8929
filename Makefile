# Quick start: `make demo` and `make test` work on a fresh Debian machine (as root).
# Every target is safe to run twice: it installs only what is missing.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEB_PACKAGES := slurmctld slurmd slurm-client munge debootstrap prometheus prometheus-node-exporter chromium logrotate
PYTEST_ARGS ?=

LANES  := build/lanes
# Every lane runs the whole suite but trixie (24.11), which runs tests/unit: the cluster tests run
# on the oldest Slurm (the host, 22.05, with torch) and the newest (forky, 26.05), the unit tests
# on all three. Each lane runs through ci/run_lane.py: the suite on LANE_WORKERS xdist workers
# (each with its own local Slurm cluster, munge, emulator and temporary root; the cluster tests
# mostly wait), then the few `serial` tests alone. Figures: docs/dev/tests.md.
# TRIXIE_PYTEST_ARGS= runs trixie's whole suite too (then set TRIXIE_TEST_TIMEOUT_S=1500).
FORKY_PYTEST_ARGS  ?= $(PYTEST_ARGS)
TRIXIE_PYTEST_ARGS ?= tests/unit $(PYTEST_ARGS)
# Workers per lane, measured on 2 cores and 24 GiB (docs/dev/tests.md): the cluster folder waits,
# so 4 workers; the unit folder computes, so as many as the cores.
HOST_WORKERS   ?= 4
FORKY_WORKERS  ?= 4
TRIXIE_WORKERS ?= 2
# Hang guards, in seconds: the lanes run one after the other, so set-up (apt, the venvs, both
# chroots: ~6 min on a new machine) plus the three guards stay under 60 of CI's hard 90 minutes
# whatever hangs (tests/unit/test_ci_lanes.py); a single stuck test fails at its own budget
# (pytest-timeout, pyproject) long before. Each is ~2x its lane's measured time.
HOST_TEST_TIMEOUT_S   ?= 1680
FORKY_TEST_TIMEOUT_S  ?= 1200
TRIXIE_TEST_TIMEOUT_S ?= 300

.PHONY: deps venv test test-host test-trixie test-forky test-fast test-cluster demo bench clean

deps: .deps.stamp
.deps.stamp:
	@missing=""; for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	$(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || missing="$$missing python3-venv"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi
	@touch $@

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,frameworks]'
	@touch $@

# The three lanes, one after the other (they share the cores): host and forky the whole suite,
# trixie tests/unit; then one line per lane saying which Slurm and Python it ran and what it ran.
# Fails when any lane failed or ran no test.
test: deps venv
	@rm -f $(LANES)/*.summary; mkdir -p $(LANES); rc=0; \
	$(MAKE) --no-print-directory test-host || rc=1; \
	$(MAKE) --no-print-directory test-trixie || rc=1; \
	$(MAKE) --no-print-directory test-forky || rc=1; \
	echo "== test lanes"; \
	for lane in host trixie forky; do \
	  cat $(LANES)/$$lane.summary 2>/dev/null || echo "lane $$lane: did not finish -- FAILED (see above)"; \
	done; \
	exit $$rc

# This machine's Slurm and Python (Debian 12: Slurm 22.05, Python 3.11).
test-host: deps venv
	@VENV=$(VENV) HOST_TEST_TIMEOUT_S=$(HOST_TEST_TIMEOUT_S) LANE_WORKERS=$(HOST_WORKERS) \
	  LANE_SUMMARY_FILE=$(CURDIR)/$(LANES)/host.summary ci/host-lane.sh $(PYTEST_ARGS)

# Debian 13's Slurm 24.11 and Python 3.13 in a cached debootstrap chroot (root; see
# ci/debian-lane.sh): tests/unit only, unless TRIXIE_PYTEST_ARGS says otherwise.
test-trixie:
	@LANE_SUMMARY_FILE=$(CURDIR)/$(LANES)/trixie.summary LANE_TEST_TIMEOUT_S=$(TRIXIE_TEST_TIMEOUT_S) \
	  LANE_WORKERS=$(TRIXIE_WORKERS) \
	  ci/trixie-lane.sh $(TRIXIE_PYTEST_ARGS)

# Debian testing's Slurm 26.05 and Python 3.14, the same way (ci/forky-lane.sh): the whole
# suite, unless FORKY_PYTEST_ARGS says otherwise.
test-forky:
	@LANE_SUMMARY_FILE=$(CURDIR)/$(LANES)/forky.summary LANE_TEST_TIMEOUT_S=$(FORKY_TEST_TIMEOUT_S) \
	  LANE_WORKERS=$(FORKY_WORKERS) \
	  ci/forky-lane.sh $(FORKY_PYTEST_ARGS)

# tests/unit: no cluster, no emulator (about 2 minutes on 2 cores). The folder is the mark:
# tests/cluster/conftest.py marks every test there `cluster`.
test-fast: venv
	$(PY) -m pytest -q tests/unit -m "not slow" $(PYTEST_ARGS)

# tests/cluster only: the local Slurm cluster, the Cloud Storage emulator, the fake Compute and
# metadata servers, torch processes (this machine's lane; `make test` runs all three lanes).
test-cluster: deps venv
	$(PY) -m pytest -q tests/cluster -n $(HOST_WORKERS) --dist worksteal $(PYTEST_ARGS)

demo: deps venv
	$(VENV)/bin/slurmagent demo

bench: deps venv
	$(PY) bench/prolog.py

clean:
	rm -rf $(VENV) .deps.stamp .pytest_cache build *.egg-info
