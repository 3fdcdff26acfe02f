# `make demo` and `make test` do all set-up themselves (a virtual environment in .venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CORE := $(VENV)/.fkv-core
FULL := $(VENV)/.fkv-full

.PHONY: demo test lint bench venv clean

# the library alone (numpy, numba, h5py, scipy): all the demo needs
$(CORE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $(CORE)

# every extra, for the tests: the CPU build of torch first, so `models` does not pull a CUDA build
$(FULL): $(CORE)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[models,gpu,dask,dev,remote,test]'
	touch $(FULL)

venv: $(FULL)

demo: $(CORE)
	$(PY) -m fkvstore.demo

# the remote extras are installed here, so their tests must run, not skip (docs/remote.md)
test: $(FULL)
	FKV_REQUIRE_REMOTE=1 $(PY) -m pytest -q

lint: $(FULL)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy fkvstore

bench: $(FULL)
	$(PY) bench/codec.py

clean:
	rm -rf $(VENV) build *.egg-info
