# The two entry points for a newcomer: `make run` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: run test install clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

# Runs the main job: the OpenAI-compatible server on the embedded default model, at http://127.0.0.1:8000.
run: install
	$(VENV)/bin/deltaserve serve

# OpenMP threads that spin while waiting slow everything down ~10x when another process shares the 2 cores.
test: install
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
