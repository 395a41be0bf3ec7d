# The two commands a new user needs: `make demo` and `make test`.
# Each builds .venv on first use (torch first, from the pinned releases), then runs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kiln-installed
WRITE_BYTECODE := env -u PYTHONDONTWRITEBYTECODE
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test check lint types quick-tests docs install prometheus bench clean check-extras

# uv installs wheels side by side: torch's from this machine's disk in 11 s instead of pip's 32,
# the test extra in 19 instead of 33 (measured with an empty cache). It reads none of pip's
# settings, so it gets pip's extra indexes, find-links and constraints (where a machine keeps its
# wheels and caps torch), every index trusted alike as pip trusts them. Like `pip --no-compile`,
# it writes no bytecode: that is written for the modules a run imports (below, and by the tests).
PIP_SETTING = $(shell $(PYTHON) -m pip config list 2>/dev/null | sed -n "s/^[^.]*\.$(1)='\(.*\)'$$/\1/p" | head -1)
UV_INSTALL = UV_INDEX_STRATEGY=unsafe-best-match \
  UV_EXTRA_INDEX_URL="$(call PIP_SETTING,extra-index-url)" \
  UV_FIND_LINKS="$(call PIP_SETTING,find-links)" UV_CONSTRAINT="$(call PIP_SETTING,constraint)" \
  $(VENV)/bin/uv pip install --quiet --python $(PY)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet 'uv>=0.5'
	$(UV_INSTALL) torch==2.14.1 torchvision==0.29.1
	$(UV_INSTALL) -e '.[test]'
	# The Helm chart's tests use the Helm library bundled by helm-sdkpy: it declares
	# Python >= 3.12, but its library loads on 3.11 (no pure-Python part needs 3.12).
	$(PY) -m pip install --quiet --ignore-requires-python 'helm-sdkpy==0.1.32'
	# Bytecode for what every Kiln process imports, written once here: otherwise the first
	# processes of a parallel test run each compile torch's modules (5 s of CPU apiece).
	$(PY) -c 'import kiln.cli, kiln.controller.main, kiln_trainer.loop'
	touch $(STAMP)

# Debian's Prometheus server for the dashboard tests, which start it on 127.0.0.1 themselves.
prometheus:
	@command -v prometheus >/dev/null || $(SUDO) apt-get install -y --no-install-recommends prometheus \
	  || ($(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends prometheus)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kiln run --slots 1 examples/digits-resnet.yaml examples/digits-resnet-deeper.yaml
	$(VENV)/bin/kiln run --slots 2 examples/sweep/*.yaml

# The docs site first: --strict fails on a broken link or anchor (site/ is git-ignored).
# Then every test, on one pytest-xdist worker per core: more workers only add CPU, each
# collecting every module and starting its own servers (docs/testing.md has the measurements).
# --durations lists the 30 slowest tests at the end, so growth shows.
TEST_WORKERS ?= 2
test: $(STAMP) prometheus docs
	# The suite writes bytecode (and pytest its rewritten test modules) whatever
	# PYTHONDONTWRITEBYTECODE says: its hundreds of processes then compile each module once.
	$(WRITE_BYTECODE) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=30 tests

# The quick tier, for each edit: ruff, import contracts, mypy --strict and the unit tests that
# start no process and train no model (the `process` and `training` markers), side by side; the
# tests on two workers, as mypy needs a core for a third of the time (measured back to back:
# 103 s in all against 139 s with one).
check: $(STAMP)
	@$(MAKE) --no-print-directory -j 3 --output-sync=target lint types quick-tests

lint: $(STAMP)
	$(VENV)/bin/ruff check operator trainer_image tests bench
	$(VENV)/bin/lint-imports --no-cache

types: $(STAMP)
	$(VENV)/bin/mypy operator/kiln trainer_image/kiln_trainer

quick-tests: $(STAMP)
	$(WRITE_BYTECODE) $(PY) -m pytest -q -n 2 -m "not process and not training" tests/unit

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir site

bench: $(STAMP)
	$(PY) bench/trainer.py

# Each install extra in a clean virtual environment (CPU torch): the base runs the trainer and
# `kiln validate` without kopf, Pyomo or matplotlib; [operator] adds `kiln operator`; [plot]
# adds `kiln plot`. Minutes and downloads, so not part of `make test` (tests/unit/test_extras.py
# checks the base there by hiding the extras' packages).
# Torch comes from the same place as `make install`'s; TORCH_INDEX=https://download.pytorch.org/whl/cpu
# takes the smaller CPU build instead.
EXTRAS_VENV := .venv-extras
TORCH_INDEX ?=
check-extras:
	rm -rf $(EXTRAS_VENV) && $(PYTHON) -m venv $(EXTRAS_VENV)
	$(EXTRAS_VENV)/bin/pip install --quiet torch==2.14.1 torchvision==0.29.1 \
	  $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(EXTRAS_VENV)/bin/pip install --quiet '.[trainer]'
	$(EXTRAS_VENV)/bin/python -c "import kiln_trainer.loop, kiln_trainer.cli, kiln.cli"
	! $(EXTRAS_VENV)/bin/python -c "import kopf" 2>/dev/null
	! $(EXTRAS_VENV)/bin/python -c "import pyomo" 2>/dev/null
	$(EXTRAS_VENV)/bin/kiln validate examples/digits-resnet.yaml
	# The base trains: one short run on real digits, planned by the heuristic (no Pyomo).
	cd $$(mktemp -d) && $(CURDIR)/$(EXTRAS_VENV)/bin/kiln run $(CURDIR)/examples/sweep/cnn-lr-002.yaml
	! $(EXTRAS_VENV)/bin/kiln operator --help 2>/dev/null
	$(EXTRAS_VENV)/bin/pip install --quiet '.[operator,plot]'
	$(EXTRAS_VENV)/bin/kiln operator --help >/dev/null
	$(EXTRAS_VENV)/bin/kiln plot --help >/dev/null
	rm -rf $(EXTRAS_VENV)

clean:
	rm -rf $(VENV) .kiln site
