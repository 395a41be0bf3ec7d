# The two commands a new user needs: `make demo` and `make test`.
# Each builds .venv on first use (torch first, from the pinned releases), then runs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kiln-installed
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test docs install prometheus bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install --quiet -e '.[test]'
	# The Helm chart's tests use the Helm library bundled by helm-sdkpy: it declares
	# Python >= 3.12, but its library loads on 3.11 (no pure-Python part needs 3.12).
	$(PY) -m pip install --quiet --ignore-requires-python 'helm-sdkpy==0.1.32'
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
test: $(STAMP) prometheus docs
	$(PY) -m pytest -q tests

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir site

bench: $(STAMP)
	$(PY) bench/trainer.py

clean:
	rm -rf $(VENV) .kiln site
