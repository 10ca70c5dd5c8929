# Quick start: `make demo` and `make test` work on a fresh Debian machine (as root).
# Every target is safe to run twice: it installs only what is missing.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEB_PACKAGES := slurmctld slurmd slurm-client munge
PYTEST_ARGS ?=

.PHONY: deps venv test test-fast demo bench clean

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

test: deps venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: venv
	$(PY) -m pytest -q -m "not slurm and not slow" $(PYTEST_ARGS)

demo: deps venv
	$(VENV)/bin/slurmagent demo

bench: deps venv
	$(PY) bench/prolog.py

clean:
	rm -rf $(VENV) .deps.stamp .pytest_cache build *.egg-info
