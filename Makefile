# The two commands a new user needs: `make demo` and `make test`.
# Each builds .venv on first use (torch first, from the pinned releases), then runs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kiln-installed

.PHONY: demo test install bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kiln run --slots 1 examples/digits-resnet.yaml examples/digits-resnet-deeper.yaml
	$(VENV)/bin/kiln run --slots 2 examples/sweep/*.yaml

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) bench/trainer.py

clean:
	rm -rf $(VENV) .kiln
