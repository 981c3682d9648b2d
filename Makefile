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

# The native kernels' tests against their torch twins. `make test` runs them again on a build for any AVX2+FMA
# x86-64 CPU (x86-64-v3, as most laptops) besides the one for this CPU; that build has no AMX tiles, by design.
NATIVE_TESTS := tests/test_native.py tests/test_native_mx.py tests/test_native_ops.py tests/test_native_program.py tests/test_opsets.py \
	--deselect tests/test_native.py::test_tiles_are_usable_where_the_cpu_has_amx_bf16

# OpenMP threads that spin while waiting slow everything down ~10x when another process shares the 2 cores. The
# slowest tests are listed at the end: the suite is kept under 20 minutes on 2 cores.
test: install
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q --durations=15
	if [ "$$(uname -m)" = x86_64 ]; then \
		OMP_WAIT_POLICY=PASSIVE DELTASERVE_NATIVE_MARCH=x86-64-v3 $(PY) -m pytest -q $(NATIVE_TESTS); fi

clean:
	rm -rf $(VENV) build *.egg-info
